"""Real vLLM (CPU) with CacheTierConnector and ``kv_events_config``: what our tiers store goes
out on vLLM's own ZMQ publisher, beside vLLM's events of its own pool.

The engine runs in a fresh subprocess (this file is also the script it runs), which subscribes
with a plain ZMQ SUB socket before vLLM binds its publisher, runs one prompt, then one-token
requests until the disk tier's events have come (a writer's events reach vLLM at the worker's
next step, and an idle engine steps no more), and decodes every batch with vLLM's own
``KVEventBatch`` decoder. Batches the SUB socket missed while it joined are replayed from
vLLM's replay socket, so the test sees every batch from the first.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.children import run_spec_module, spec_main

BLOCK_SIZE = 32  # vLLM-CPU's attention takes multiples of 32
RECORD_TOKENS = 16  # the default: two records per block
PROMPT_LEN = 100  # 3 full blocks, 6 records
SHORT = [1000, 1001, 1002]  # under a block: its steps only carry the tiers' events
NUM_RECORDS = PROMPT_LEN // BLOCK_SIZE * BLOCK_SIZE // RECORD_TOKENS
TOPIC = "kv"
DRAIN_STEPS = 200
QUIET_MS = 200
RUN_TIMEOUT_S = 600
END_SEQ = -1

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.slow(reason="starts a vLLM-CPU process that imports vLLM and loads SmolLM2"),
]


def _prompt() -> list[int]:
    rng = random.Random(20261130)  # shares no prefix with any other test's prompt
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


def _keys(model_dir: Path) -> list[str]:
    """The prompt's record keys, as the connector names them (hex)."""
    from cachetier.engine.model_spec import ModelSpec
    from cachetier.primitives.fingerprint import model_fingerprint
    from cachetier.primitives.keys import KVLayout, Namespace, block_keys

    spec = ModelSpec.from_folder(model_dir)
    layout = KVLayout("float32", RECORD_TOKENS, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    namespace = Namespace(model_fingerprint(model_dir), layout, "")
    return [key.hex() for key in block_keys(namespace, _prompt())]


# The subprocess side.


def _receive(sub: Any, batches: dict[int, bytes]) -> None:
    """Every batch the SUB socket holds, until it has been quiet for ``QUIET_MS``."""
    while sub.poll(QUIET_MS):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode(), topic
        batches[int.from_bytes(seq, "big")] = payload


def _replay(context: Any, endpoint: str, batches: dict[int, bytes]) -> None:
    """Fill ``batches`` from vLLM's replay socket, from sequence number 0 on."""
    import zmq

    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    while True:
        _, _, seq, payload = dealer.recv_multipart()
        number = int.from_bytes(seq, "big", signed=True)
        if number == END_SEQ:
            break
        batches[number] = payload
    dealer.close(linger=0)


def _as_json(event: Any) -> dict[str, Any]:
    def name(block_hash: bytes | int) -> str | int:
        return block_hash.hex() if isinstance(block_hash, bytes) else block_hash

    out: dict[str, Any] = {"type": type(event).__name__, "medium": getattr(event, "medium", None)}
    if hasattr(event, "block_hashes"):
        out["hashes"] = [name(h) for h in event.block_hashes]
    if hasattr(event, "token_ids"):
        parent = event.parent_block_hash
        out.update(
            parent=None if parent is None else name(parent),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
        )
    return out


def _disk_holds_all(batches: dict[int, bytes], decoder: Any, keys: list[str]) -> bool:
    disk = set()
    for payload in batches.values():
        for event in map(_as_json, decoder.decode(payload).events):
            if event["type"] == "BlockStored" and event["medium"] == "disk":
                disk.update(event["hashes"])
    return disk >= set(keys)


def _run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVEventBatch

    from cachetier.connectors.vllm.launch import kv_transfer_config

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(spec["endpoint"])  # ZMQ connects once vLLM binds it
    extra = {"guard": False, "cpu_bytes": 64 << 20, "disk_path": spec["disk"]}
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=512,
        seed=0,
        kv_transfer_config=kv_transfer_config(extra),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["endpoint"],
            replay_endpoint=spec["replay"],
            topic=TOPIC,
        ),
    )
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches: dict[int, bytes] = {}
    llm.generate([{"prompt_token_ids": _prompt()}], SamplingParams(max_tokens=2), use_tqdm=False)
    for _ in range(DRAIN_STEPS):
        _receive(sub, batches)
        if _disk_holds_all(batches, decoder, spec["keys"]):
            break
        llm.generate([{"prompt_token_ids": SHORT}], SamplingParams(max_tokens=1), use_tqdm=False)
    replayed = sorted(batches) != list(range(len(batches)))
    if replayed:  # the SUB socket joined after the first batches went out
        _replay(context, spec["replay"], batches)
    events = [
        [_as_json(event) for event in decoder.decode(batches[seq]).events]
        for seq in sorted(batches)
    ]
    llm.llm_engine.engine_core.shutdown()
    sub.close(linger=0)
    return {"seqs": sorted(batches), "batches": events, "replayed": replayed}


def _main() -> None:
    spec_main(_run_engine, __doc__)


# The pytest side.


def _stored(batches: list[list[dict[str, Any]]], medium: str) -> list[dict[str, Any]]:
    return [e for b in batches for e in b if e["type"] == "BlockStored" and e["medium"] == medium]


def test_vllm_publishes_what_our_cpu_and_disk_tiers_store(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> None:
    workdir = tmp_path_factory.mktemp("kvev")
    keys = _keys(smollm2_dir)
    assert len(keys) == PROMPT_LEN // RECORD_TOKENS
    spec = {
        "model": str(smollm2_dir),
        "disk": str(workdir / "disk"),
        "endpoint": f"ipc://{workdir}/pub",
        "replay": f"ipc://{workdir}/replay",
        "keys": keys[:NUM_RECORDS],
    }
    got, log = run_spec_module(
        "tests.connectors.vllm.test_kv_events_vllm", spec, workdir, "engine", timeout=RUN_TIMEOUT_S
    )
    assert got["seqs"] == list(range(len(got["seqs"]))), "a batch is missing"
    batches = got["batches"]
    saved = keys[:NUM_RECORDS]  # the prompt's full blocks; its last 4 tokens fill none
    tokens = _prompt()[: NUM_RECORDS * RECORD_TOKENS]
    for medium in ("cpu", "disk"):
        events = [e for e in _stored(batches, medium) if set(e["hashes"]) & set(saved)]
        assert [h for e in events for h in e["hashes"]] == saved, (medium, events)
        # Their tokens and chain, as the connector noted them when it saved the blocks.
        assert [t for e in events for t in e["token_ids"]] == tokens, medium
        assert events[0]["parent"] is None
        assert all(e["block_size"] == RECORD_TOKENS for e in events)
    # vLLM's own pool published in the same batches (its hashes are its own, as ints).
    assert any(e["medium"] == "GPU" for batch in batches for e in batch), batches[:2]
    assert "KV events on for tiers ['cpu', 'disk']" in log


if __name__ == "__main__":
    _main()
