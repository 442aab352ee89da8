"""``AsyncEngine`` on its own: outputs reach the caller's loop, times are taken after the step
that made a token, leaving early aborts, and shutdown fails what is still in flight."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from pathlib import Path

import pytest

from cachetier.engine.config import EngineConfig
from cachetier.engine.llm_engine import LLMEngine, RequestOutput
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.server.async_engine import AsyncEngine, EngineDeadError

PROMPT = [(i * 5 + 1) % 250 for i in range(40)]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[RequestOutput, float, float | None, float]] = []

    def on_output(
        self, output: RequestOutput, arrival_s: float, previous_token_s: float | None, now: float
    ) -> None:
        self.calls.append((output, arrival_s, previous_token_s, now))


@pytest.fixture
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=4 << 20))


def test_outputs_arrive_with_times_taken_after_each_step(engine: LLMEngine) -> None:
    recorder = Recorder()
    runner = AsyncEngine(engine, recorder)
    runner.start()

    async def run() -> list[RequestOutput]:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        return [out async for out in runner.generate(PROMPT, params, "r1")]

    outputs = asyncio.run(run())
    runner.shutdown()
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4, 5] and outputs[-1].finished
    first, arrival_s, previous, now = recorder.calls[0]
    assert previous is None
    # The engine's own TTFT starts when it took the request and ends after the sampling step:
    # the observer's, from arrival to after the step, cannot be shorter.
    assert first.ttft_s is not None and now - arrival_s >= first.ttft_s
    assert [c[2] for c in recorder.calls[1:]] == [c[3] for c in recorder.calls[:-1]]
    assert runner.stats()["num_running"] == 0


def test_leaving_early_aborts_and_shutdown_fails_the_rest(engine: LLMEngine) -> None:
    runner = AsyncEngine(engine)
    runner.start()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def leave_after_two() -> None:
        async with aclosing(runner.generate(PROMPT, params, "left")) as outputs:
            async for out in outputs:
                if len(out.token_ids) == 2:
                    break
        # Closed, not finished: the abort reaches the engine thread, which then goes idle.
        deadline = time.monotonic() + 60
        while runner.stats()["num_running"]:
            assert time.monotonic() < deadline, "the request was not aborted"
            await asyncio.sleep(0.01)

    async def refused() -> None:
        async for _ in runner.generate([999], params, "bad"):
            pass

    asyncio.run(leave_after_two())
    with pytest.raises(ValueError, match="vocabulary|token ids"):
        asyncio.run(refused())
    runner.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.num_decode_tokens < 100  # nowhere near the 500 asked for
    assert not runner.is_alive

    async def too_late() -> None:
        async for _ in runner.generate(PROMPT, params, "late"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(too_late())
