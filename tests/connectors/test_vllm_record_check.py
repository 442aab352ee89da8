"""The worker's check of every loaded record, on vLLM-CPU-shaped pages and a real disk tier, with
records of a real (tiny, random) Llama's KV: honest records load; a forged one is refused (vLLM
recomputes it) and its writer quarantined; a new writer's first load is computed and compared
when vLLM saves the blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from cachetier.connectors.config import ConnectorConfig, open_store  # noqa: E402
from cachetier.connectors.vllm.layouts import CPU_VEC, VllmArrangement  # noqa: E402
from cachetier.connectors.vllm.metadata import (  # noqa: E402
    BlockTransfer,
    CacheTierConnectorMetadata,
)
from cachetier.connectors.vllm.paged import PagedKV  # noqa: E402
from cachetier.connectors.vllm.worker import CacheTierWorker  # noqa: E402
from cachetier.guard import GuardConfig, GuardSampler  # noqa: E402
from cachetier.guard.first_layer import FirstLayer  # noqa: E402
from cachetier.guard.record_check import RecordCheck  # noqa: E402
from cachetier.primitives.keys import KVLayout, Namespace, block_keys  # noqa: E402
from cachetier.record import KVBlock, writer_name  # noqa: E402
from cachetier.store.tiered import TieredStore  # noqa: E402
from tests.cachetier.guard_records import model_kv  # noqa: E402

pytestmark = pytest.mark.vllm

BS, NUM_BLOCKS = 32, 8
TOKENS = [int(t) for t in np.random.default_rng(9).integers(0, 256, size=3 * BS + 4)]
HONEST = b"h" * 16


@pytest.fixture(scope="module")
def kv(tiny_model_dir: Path) -> np.ndarray:
    return model_kv(tiny_model_dir, TOKENS)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with open_store(
        ConnectorConfig.from_extra_config({"cpu_bytes": 0, "disk_path": str(tmp_path)}),
        with_cpu=False,
    ) as s:
        yield s


def _layout(kv: np.ndarray) -> KVLayout:
    return KVLayout("float32", BS, kv.shape[0], kv.shape[3], kv.shape[4])


def _records(kv: np.ndarray, namespace: Namespace, swap: int | None = None) -> list[KVBlock]:
    out = []
    for i, key in enumerate(block_keys(namespace, TOKENS)):
        values = np.ascontiguousarray(kv[:, :, i * BS : (i + 1) * BS])
        if i == swap:
            values = np.ascontiguousarray(values[:, ::-1])  # K and V swapped: checksums pass
        shape = values.shape
        out.append(
            KVBlock(
                key, namespace.fingerprint, "float32", shape, BS, values.tobytes(), writer=HONEST
            )
        )
    return out


def _worker(
    store: TieredStore, kv: np.ndarray, model_dir: Path, first_hits: int
) -> tuple[CacheTierWorker, PagedKV]:
    layout = _layout(kv)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers)]
    arrangement = VllmArrangement(CPU_VEC, layout)
    worker = CacheTierWorker(
        store,
        arrangement,
        names,
        BS,
        record_check=RecordCheck(FirstLayer.from_folder(model_dir)),
        guard=GuardSampler(GuardConfig(first_hits=first_hits, fraction=0.0)),
    )
    shape = (NUM_BLOCKS, layout.num_kv_heads, BS, 2 * layout.head_dim)
    caches = {name: torch.zeros(shape) for name in names}
    worker.register_kv_caches(caches)
    return worker, PagedKV(caches, names, arrangement)


def _load(worker: CacheTierWorker, namespace: Namespace, keys: list) -> set[int]:
    transfer = BlockTransfer(
        "r",
        namespace.id,
        namespace.fingerprint,
        tuple(keys),
        (1, 2, 3),
        token_ids=tuple(TOKENS[: 3 * BS]),
        first_position=0,
    )
    worker.step_started()
    worker.load(CacheTierConnectorMetadata(loads=[transfer]))
    return worker.take_failed_block_ids()


def test_honest_records_load_and_a_forged_one_is_refused(
    store: TieredStore, kv: np.ndarray, tiny_model_dir: Path
) -> None:
    namespace = Namespace("tiny", _layout(kv))
    records = _records(kv, namespace)
    store.put_many(namespace.id, records)
    store.flush()
    worker, _ = _worker(store, kv, tiny_model_dir, first_hits=0)
    assert _load(worker, namespace, [r.key for r in records]) == set()
    # The same writer's record of block 1, rewritten wrong: vLLM recomputes blocks 1 and 2.
    store.delete(namespace.id, [records[1].key])
    store.put_many(namespace.id, [_records(kv, namespace, swap=1)[1]])
    store.flush()
    assert _load(worker, namespace, [r.key for r in records]) == {2, 3}
    assert store.quarantines.holds_writer("disk", namespace.id, writer_name(HONEST))
    assert store.get_many(namespace.id, [records[1].key]) == [None]  # deleted
    worker.close()


def test_a_new_writers_first_load_is_computed_and_compared(
    store: TieredStore, kv: np.ndarray, tiny_model_dir: Path
) -> None:
    namespace = Namespace("tiny", _layout(kv))
    records = _records(kv, namespace)
    store.put_many(namespace.id, records)
    store.flush()
    worker, pages = _worker(store, kv, tiny_model_dir, first_hits=1)
    assert _load(worker, namespace, [r.key for r in records]) == {1, 2, 3}  # verified first
    # vLLM computes the blocks into its pages and saves them: each is compared with the disk's
    # record of its key before it is stored, and found clean.
    worker.step_started()  # a later step: vLLM recomputes the blocks it was told failed
    worker.load(CacheTierConnectorMetadata())
    pages.write([1, 2, 3], [r.data for r in records])
    save = BlockTransfer(
        "r", namespace.id, namespace.fingerprint, tuple(r.key for r in records), (1, 2, 3)
    )
    worker.save(CacheTierConnectorMetadata(saves=[save]))
    store.flush()
    assert store.stats()["guard"]["verified_blocks"] == {"disk": 3}
    assert not store.quarantines.entries()
    assert _load(worker, namespace, [r.key for r in records]) == set()  # trusted now
    worker.close()
