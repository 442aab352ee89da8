"""benchmarks.peers.common.interleaved_checked: ops in turn, each checked, and the meters read
around them."""

from __future__ import annotations

import pytest

from benchmarks.peers.common import Timed, interleaved_checked


def test_meters_give_each_ops_growth_per_kept_sample() -> None:
    done: dict[str, int] = {"a": 0, "b": 0}
    order: list[str] = []

    def op(name: str, step: int) -> Timed:
        def run() -> str:
            order.append(name)
            done[name] += step
            return name

        def check(got: str) -> None:
            assert got == name

        return Timed(run, check)

    runs = {"a": op("a", 1), "b": op("b", 3)}
    out = interleaved_checked(runs, repeats=3, warmup=2, meters={"work": lambda n: done[n]})
    assert order == ["a", "b"] * 5  # in turn, warm-up rounds included
    assert out["a_work"] == [1, 1, 1] and out["b_work"] == [3, 3, 3]  # warm-up not kept
    assert len(out["a_samples"]) == 3 and out["a"] > 0
    assert isinstance(out["a_minflt"], int)


def test_a_wrong_result_fails_the_measurement() -> None:
    def check(got: int) -> None:
        if got != 1:
            raise AssertionError("wrong")

    with pytest.raises(AssertionError, match="wrong"):
        interleaved_checked({"x": Timed(lambda: 2, check)}, repeats=1, warmup=0)
