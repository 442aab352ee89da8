"""Real vLLM (CPU) with CacheTierConnector: KV stored by one process is used after a restart.

Each engine runs in a fresh subprocess (this file is also the script it runs). Process A runs
vLLM without the connector (the baseline) and then with it, storing the prompt's blocks on disk
and in Redis; each restart is another process that must report the prompt's full blocks as
cached, log the load from the tier, and generate exactly the baseline's greedy tokens and top-5
logprobs. A record tampered with on disk must be caught and recomputed, with the same output.
"""

from __future__ import annotations

import ast
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.children import run_spec_module, spec_main
from tests.support import own_redis_prefix

BLOCK_SIZE = 32  # vLLM-CPU's attention takes multiples of 32
RECORD_TOKENS = 16  # the default: two records per block
PROMPT_LEN = 1100  # 34 full blocks; vLLM computes the last 12 tokens itself
MAX_TOKENS = 6
TOP_LOGPROBS = 5
LOGPROB_ATOL = 1e-3
NUM_FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE
TAMPERED_RECORDS = (7, 20)  # record indexes that get flipped bytes (in blocks 3 and 10)
FIRST_BAD_BLOCK = min(TAMPERED_RECORDS) * RECORD_TOKENS // BLOCK_SIZE
RUN_TIMEOUT_S = 600
PINNED_RESTORE = {"kv_load_policy": "always", "redis_timeout_s": 60.0}

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.slow(reason="starts vLLM-CPU processes that each import vLLM and load SmolLM2"),
]


def _prompt() -> list[int]:
    # Random ids in SmolLM2's ordinary-token range: long, and shares no prefix with any other test.
    rng = random.Random(20240611)
    return [rng.randrange(1000, 48000) for _ in range(PROMPT_LEN)]


# The subprocess side: run each engine of a spec, one after the other, and write the outputs.


def _run_engines(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import gc

    from vllm import LLM, SamplingParams

    from cachetier.connectors.vllm.launch import kv_transfer_config

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
    results = []
    for run in spec["runs"]:
        kwargs: dict[str, Any] = {}
        if run["kv_extra"] is not None:
            # The guard off unless a run names it: these runs check restores (the guard has
            # its own tests: test_vllm_guard.py, tests/benchmarks/test_guard.py). Every hit
            # loaded, whatever the cost model would pick on a busy machine, and a Redis timeout
            # no load here comes near: the runs check that a restore is right, not that it pays.
            extra = {"guard": False, **PINNED_RESTORE, **run["kv_extra"]}
            kwargs["kv_transfer_config"] = kv_transfer_config(extra)
        llm = LLM(
            model=spec["model"],
            dtype="float32",
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            max_model_len=2048,
            seed=0,
            **spec.get("engine_args", {}),
            **kwargs,
        )
        print(f"=== run {run['name']} start", flush=True)
        (output,) = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)
        completion = output.outputs[0]
        results.append(
            {
                "name": run["name"],
                "num_cached_tokens": output.num_cached_tokens,
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    {str(token): float(lp.logprob) for token, lp in step.items()}
                    for step in completion.logprobs or []
                ],
            }
        )
        print(f"=== run {run['name']} done", flush=True)
        # Shutting the engine down shuts the connector down, which flushes its disk and Redis
        # writes before the next engine (or the next process) reads them.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return results


def _main() -> None:
    spec_main(_run_engines, __doc__)


# The pytest side.


class EngineProcess:
    """Runs ``_run_engines`` in a fresh Python process and keeps its log."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def run(self, name: str, model: Path, runs: list[dict[str, Any]]) -> tuple[list[dict], str]:
        spec = {"model": str(model), "prompt": _prompt(), "runs": runs}
        return run_spec_module(
            "tests.connectors.test_vllm_restart", spec, self.workdir, name, timeout=RUN_TIMEOUT_S
        )


def _load_lines(log: str) -> list[str]:
    return [
        line for line in log.splitlines() if "cachetier: request" in line and " loaded " in line
    ]


def assert_logged_full_load(log: str, tier: str) -> None:
    """The log shows every full block of the prompt loaded from ``tier``."""
    n = NUM_FULL_BLOCKS
    want = f"loaded {n}/{n} blocks ({n * BLOCK_SIZE} tokens) from {{'{tier}': {n}}}"
    lines = _load_lines(log)
    assert any(want in line for line in lines), f"no load from {tier} in the log: {lines}"


def assert_same_output(got: dict, want: dict) -> None:
    """Greedy tokens equal; top-5 logprobs name the same tokens and agree within 1e-3."""
    assert got["token_ids"] == want["token_ids"], (got["name"], want["name"])
    assert len(got["logprobs"]) == len(want["logprobs"]) == MAX_TOKENS
    for step, (g, w) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
        top_g = sorted(g, key=g.get, reverse=True)[:TOP_LOGPROBS]
        top_w = sorted(w, key=w.get, reverse=True)[:TOP_LOGPROBS]
        assert set(top_g) == set(top_w), f"step {step}: top tokens {top_g} != {top_w}"
        for token in top_w:
            assert abs(g[token] - w[token]) <= LOGPROB_ATOL, (step, token, g[token], w[token])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-restart")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from cachetier.engine.smollm2 import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def module_redis_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this module's own; every key under it is deleted afterwards."""
    with own_redis_prefix(redis_url, "cachetier-vllm-test") as prefix:
        yield prefix


@pytest.fixture(scope="module")
def stored(
    workdir: Path, model_dir: Path, redis_url: str, module_redis_prefix: str
) -> dict[str, Any]:
    """Process A: the baseline without the connector, then a run that stores the prompt."""
    disk = workdir / "disk"
    extra = {
        "cpu_bytes": 256 << 20,
        "disk_path": str(disk),
        "redis_url": redis_url,
        "redis_key_prefix": module_redis_prefix,
    }
    results, log = EngineProcess(workdir).run(
        "store",
        model_dir,
        [{"name": "baseline", "kv_extra": None}, {"name": "store", "kv_extra": extra}],
    )
    baseline, store = results
    return {"baseline": baseline, "store": store, "log": log, "disk": disk}


def _namespace(model_dir: Path):
    from cachetier.engine.model_spec import ModelSpec
    from cachetier.primitives.fingerprint import model_fingerprint
    from cachetier.primitives.keys import KVLayout, Namespace

    spec = ModelSpec.from_folder(model_dir)
    layout = KVLayout("float32", RECORD_TOKENS, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    return Namespace(model_fingerprint(model_dir), layout, "")


def _record_paths(disk: Path, model_dir: Path) -> list[Path]:
    """Where the disk tier keeps each full record of the prompt, in prompt order."""
    from cachetier.primitives.keys import block_keys
    from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig

    namespace = _namespace(model_dir)
    with DiskTier(DiskTierConfig(root=str(disk), capacity_bytes=1 << 40)) as tier:
        return [tier.path_of(namespace.id, key) for key in block_keys(namespace, _prompt())]


def test_store_run_saves_every_full_block(stored: dict[str, Any], model_dir: Path) -> None:
    assert stored["store"]["num_cached_tokens"] == 0, "process A started from an empty store"
    assert_same_output(stored["store"], stored["baseline"])
    paths = _record_paths(stored["disk"], model_dir)
    assert len(paths) == PROMPT_LEN // BLOCK_SIZE * BLOCK_SIZE // RECORD_TOKENS
    missing = [p.name for p in paths if not p.is_file()]
    assert not missing, f"blocks not on disk after process A exited: {missing}"
    closes = re.findall(r"tier counters at close: (\{.*\}); (\d+) blocks dropped", stored["log"])
    assert closes, "the worker did not log its tiers' counters as it closed"
    counters, dropped = ast.literal_eval(closes[-1][0]), int(closes[-1][1])
    assert counters["disk"]["puts"] == len(paths) and dropped == 0, closes[-1]


@pytest.mark.parametrize("source", ["disk", "redis"])
def test_restart_restores_prefix(
    stored: dict[str, Any],
    workdir: Path,
    model_dir: Path,
    source: str,
    request: pytest.FixtureRequest,
) -> None:
    if source == "disk":
        extra = {"cpu_bytes": 256 << 20, "disk_path": str(stored["disk"])}
    else:  # the Redis the store run wrote through to
        extra = {
            "cpu_bytes": 0,
            "redis_url": request.getfixturevalue("redis_url"),
            "redis_key_prefix": request.getfixturevalue("module_redis_prefix"),
        }
    name = f"restore-{source}"
    (restored,), log = EngineProcess(workdir).run(
        name, model_dir, [{"name": name, "kv_extra": extra}]
    )
    assert restored["num_cached_tokens"] >= NUM_FULL_BLOCKS * BLOCK_SIZE
    assert_logged_full_load(log, source)
    # Redis is read over a network, so vLLM loaded it asynchronously (``load_async`` of
    # ``network``, the default): the request waited in WAITING_FOR_REMOTE_KVS meanwhile.
    is_async = [line.endswith("(async)") for line in _load_lines(log)]
    assert is_async == [source == "redis"], _load_lines(log)
    assert_same_output(restored, stored["baseline"])


@pytest.mark.faults
def test_tampered_block_on_disk_is_recomputed(
    stored: dict[str, Any], workdir: Path, model_dir: Path
) -> None:
    from cachetier.record import decode_record

    disk = workdir / "disk-tampered"
    shutil.copytree(stored["disk"], disk)
    paths = _record_paths(disk, model_dir)
    for index in TAMPERED_RECORDS:
        data = bytearray(paths[index].read_bytes())
        for offset in (len(data) // 2, len(data) - 1):  # inside the payload
            data[offset] ^= 0xFF
        paths[index].write_bytes(bytes(data))
    first_bad = FIRST_BAD_BLOCK
    extra = {"cpu_bytes": 256 << 20, "disk_path": str(disk)}
    (restored,), log = EngineProcess(workdir).run(
        "restore-tampered", model_dir, [{"name": "restore-tampered", "kv_extra": extra}]
    )
    lines = _load_lines(log)
    want = f"loaded {first_bad}/{NUM_FULL_BLOCKS} blocks"
    assert any(want in line and "vLLM recomputes them" in line for line in lines), lines
    assert "Recovered from KV load failure" in log, "vLLM did not reschedule the bad blocks"
    assert_same_output(restored, stored["baseline"])
    # The recomputed blocks were saved again, so the tampered records are whole once more.
    layout = _namespace(model_dir).layout
    for index in TAMPERED_RECORDS:
        record = decode_record(paths[index].read_bytes())
        assert tuple(record.shape) == layout.payload_shape


@pytest.mark.faults
def test_tampered_block_in_redis_is_recomputed_after_an_async_load(
    stored: dict[str, Any],
    workdir: Path,
    model_dir: Path,
    redis_url: str,
    module_redis_prefix: str,
) -> None:
    import redis

    from cachetier.primitives.keys import block_keys

    namespace = _namespace(model_dir)
    client = redis.Redis.from_url(redis_url)
    first_bad = FIRST_BAD_BLOCK
    # A copy of what the store run wrote, under a prefix of this test's own, with flipped
    # bytes in two records: the module's own records stay whole for the other tests.
    with own_redis_prefix(redis_url, "cachetier-vllm-tampered") as prefix:
        for index, key in enumerate(block_keys(namespace, _prompt())):
            value = client.get(f"{module_redis_prefix}:{namespace.id}:{key.hex()}")
            assert value is not None, f"block {index} is not in Redis after the store run"
            if index in TAMPERED_RECORDS:
                data = bytearray(value)
                for offset in (len(data) // 2, len(data) - 1):  # inside the payload
                    data[offset] ^= 0xFF
                value = bytes(data)
            client.set(f"{prefix}:{namespace.id}:{key.hex()}", value)
        extra = {"cpu_bytes": 0, "redis_url": redis_url, "redis_key_prefix": prefix}
        (restored,), log = EngineProcess(workdir).run(
            "restore-redis-tampered",
            model_dir,
            [{"name": "restore-redis-tampered", "kv_extra": extra}],
        )
    client.close()
    lines = _load_lines(log)
    want = f"loaded {first_bad}/{NUM_FULL_BLOCKS} blocks"
    assert any(want in line and "vLLM recomputes them" in line for line in lines), lines
    assert all("(async)" in line for line in lines), lines
    # vLLM took the request as loaded up to the first bad block and computed the rest (its
    # num_cached_tokens still counts the whole hit it was promised at allocation).
    assert "Recovered from KV load failure" in log, "vLLM did not reschedule the bad blocks"
    assert_same_output(restored, stored["baseline"])


if __name__ == "__main__":
    _main()
