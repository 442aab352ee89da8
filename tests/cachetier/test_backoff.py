"""ExponentialBackoff and CircuitBreaker, driven by a fake clock (no sleeping)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from cachetier.util.backoff import BreakerState, CircuitBreaker, ExponentialBackoff, Fault, Guard
from tests.support import FakeClock


def make_breaker(
    clock: FakeClock, threshold: int = 3, base_s: float = 0.1, cap_s: float = 0.4
) -> CircuitBreaker:
    return CircuitBreaker(threshold, ExponentialBackoff(base_s, cap_s), clock, trial_timeout_s=5.0)


def open_breaker(breaker: CircuitBreaker, threshold: int = 3) -> None:
    for _ in range(threshold):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN


def test_backoff_doubles_up_to_the_cap() -> None:
    backoff = ExponentialBackoff(0.01, 0.08)
    assert [backoff.delay_s(n) for n in range(6)] == [0.01, 0.02, 0.04, 0.08, 0.08, 0.08]
    assert backoff.delay_s(10_000) == 0.08


@pytest.mark.parametrize(("base_s", "cap_s"), [(0.0, 1.0), (-1.0, 1.0), (0.5, 0.1)])
def test_backoff_rejects_bad_settings(base_s: float, cap_s: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        ExponentialBackoff(base_s, cap_s)


def test_backoff_rejects_a_negative_attempt() -> None:
    with pytest.raises(ValueError, match="attempt"):
        ExponentialBackoff(0.1, 1.0).delay_s(-1)


def test_breaker_rejects_bad_settings() -> None:
    backoff = ExponentialBackoff(0.1, 1.0)
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(0, backoff)
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(True, backoff)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trial_timeout_s"):
        CircuitBreaker(1, backoff, trial_timeout_s=0)


def test_breaker_stays_closed_below_the_threshold_and_success_resets_the_count() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for outcome in ["fail", "fail", "ok", "fail", "fail", "ok", "fail", "fail"]:
        assert breaker.allow()
        if outcome == "ok":
            breaker.record_success()
        else:
            breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot()["num_failures"] == 2


def test_breaker_opens_at_the_threshold_and_refuses_until_the_delay() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    snap = breaker.snapshot()
    assert snap["num_opens"] == 1 and snap["retry_in_s"] == pytest.approx(0.1)
    assert not breaker.allow() and breaker.is_open
    clock.advance(0.099)
    assert not breaker.allow() and breaker.is_open
    clock.advance(0.001)
    assert not breaker.is_open  # a peek: it leaves the trial to the next allow()
    assert breaker.state is BreakerState.OPEN
    assert breaker.allow()  # the one trial
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # others wait for the trial's outcome


def test_successful_trial_closes_the_breaker() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(0.1)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert all(breaker.allow() for _ in range(5))
    assert breaker.snapshot() == {
        "state": "closed",
        "num_failures": 0,
        "num_opens": 1,
        "retry_in_s": 0.0,
    }


def test_failed_trials_double_the_delay_up_to_the_cap_and_success_resets_it() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, base_s=0.1, cap_s=0.4)
    open_breaker(breaker)
    waits = []
    for _ in range(4):
        waits.append(breaker.snapshot()["retry_in_s"])
        clock.advance(waits[-1])
        assert breaker.allow()
        breaker.record_failure()  # the trial failed: open again, for longer
        assert breaker.state is BreakerState.OPEN
    waits.append(breaker.snapshot()["retry_in_s"])
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.4, 0.4])
    assert breaker.snapshot()["num_opens"] == 5

    clock.advance(0.4)
    assert breaker.allow()
    breaker.record_success()
    open_breaker(breaker)  # a new outage starts again from the base delay
    assert breaker.snapshot()["retry_in_s"] == pytest.approx(0.1)


def test_a_late_failure_while_open_does_not_delay_the_trial() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    assert breaker.allow()  # a slow call starts while the breaker is closed
    open_breaker(breaker)
    clock.advance(0.05)
    breaker.record_failure()  # ... and fails after the breaker opened
    assert breaker.snapshot()["retry_in_s"] == pytest.approx(0.05)
    assert breaker.snapshot()["num_opens"] == 1


def test_a_lost_trial_is_replaced_after_the_trial_timeout() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(0.1)
    assert breaker.allow()  # this trial never reports back
    clock.advance(4.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_exactly_one_thread_gets_the_trial() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(0.1)
    start = threading.Barrier(16)
    allowed: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        start.wait()
        ok = breaker.allow()
        with lock:
            allowed.append(ok)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(allowed) == [False] * 15 + [True]


def _fault(exc: BaseException) -> Fault | None:
    if isinstance(exc, ConnectionResetError):
        return Fault.TRANSIENT
    if isinstance(exc, TimeoutError):
        return Fault.DOWN
    if isinstance(exc, PermissionError):
        return Fault.ANSWERED
    return None


def _guard(clock: FakeClock, retries: int = 2) -> tuple[Guard, list[str]]:
    seen: list[str] = []
    backoff = ExponentialBackoff(0.001, 0.002)
    guard = Guard(
        CircuitBreaker(2, backoff, clock),
        _fault,
        on_failure=lambda exc, fault: seen.append(f"failed {fault.value}"),
        on_skipped=lambda: seen.append("skipped"),
        backoff=backoff,
        retries=retries,
        on_retry=lambda exc: seen.append("retry"),
    )
    return guard, seen


def _failing(*errors: BaseException) -> Callable[[], str]:
    left = list(errors)

    def attempt() -> str:
        if left:
            raise left.pop(0)
        return "ok"

    return attempt


def test_guard_retries_a_transient_fault_then_returns_the_result() -> None:
    guard, seen = _guard(FakeClock())
    assert guard.call(_failing(ConnectionResetError(), ConnectionResetError()), None) == "ok"
    assert seen == ["retry", "retry"]
    assert guard.breaker.state is BreakerState.CLOSED


def test_guard_gives_up_after_its_retries_and_the_breaker_opens() -> None:
    guard, seen = _guard(FakeClock(), retries=1)
    for _ in range(2):
        assert guard.call(_failing(*[ConnectionResetError()] * 3), "missed") == "missed"
    assert seen == ["retry", "failed transient", "retry", "failed transient"]
    assert guard.breaker.state is BreakerState.OPEN
    assert guard.call(_failing(), "missed") == "missed"  # not called: skipped
    assert seen[-1] == "skipped"


def test_guard_does_not_retry_a_timeout_or_an_answer() -> None:
    guard, seen = _guard(FakeClock())
    assert guard.call(_failing(TimeoutError()), None) is None
    assert guard.breaker.snapshot()["num_failures"] == 1
    assert guard.call(_failing(PermissionError()), None) is None
    assert seen == ["failed down", "failed answered"]
    assert guard.breaker.snapshot()["num_failures"] == 0  # an answer says the service is up


def test_guard_lets_an_unknown_error_through_and_counts_it_against_the_service() -> None:
    guard, seen = _guard(FakeClock())
    with pytest.raises(KeyError):
        guard.call(_failing(KeyError("bug")), None)
    assert seen == []
    assert guard.breaker.snapshot()["num_failures"] == 1


def test_guard_acall_shares_the_decisions_of_call() -> None:
    guard, seen = _guard(FakeClock())
    left = [ConnectionResetError(), TimeoutError()]

    async def attempt() -> str:
        if left:
            raise left.pop(0)
        return "ok"

    assert asyncio.run(guard.acall(attempt, "missed")) == "missed"
    assert seen == ["retry", "failed down"]
    assert asyncio.run(guard.acall(attempt, "missed")) == "ok"
