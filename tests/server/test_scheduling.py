"""``FairScheduler``: who gets the next slot, and when a tenant is past its share of the
measured capacity. A clock of the test's own; no timing is asserted."""

from __future__ import annotations

import asyncio

from cachetier.server.fairness import TenantWeights
from cachetier.server.scheduling import MAX_QUEUE_S, RESERVE_S, FairScheduler, Held


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(num_slots: int, **weights: float) -> tuple[FairScheduler, Clock]:
    clock = Clock()
    return FairScheduler(TenantWeights(weights), num_slots, clock), clock


async def _served_order(sched: FairScheduler, clock: Clock, queued: list[str]) -> list[str]:
    """Queue one request per entry of ``queued`` behind a slot held by alice; release one slot
    at a time (each held 10 ms) and return whose request got each."""
    first = await sched.acquire("alice")
    assert isinstance(first, Held)
    tasks = [asyncio.ensure_future(sched.acquire(t, may_refuse=False)) for t in queued]
    await asyncio.sleep(0)
    order, held = [], first
    for _ in queued:
        clock.now += 0.01
        sched.release(held)
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finished = done.pop()
        tasks.remove(finished)
        held = finished.result()
        assert isinstance(held, Held)
        order.append(held.tenant)
    sched.release(held)
    return order


def test_a_tenant_arriving_behind_a_flood_gets_the_next_slot() -> None:
    sched, clock = scheduler(1, alice=1.0, bob=1.0)
    order = asyncio.run(_served_order(sched, clock, ["alice"] * 6 + ["bob"]))
    assert order[0] == "bob", order  # not behind alice's six


def test_slots_go_by_weight_while_both_tenants_wait() -> None:
    sched, clock = scheduler(1, alice=2.0, bob=1.0)
    order = asyncio.run(_served_order(sched, clock, ["alice", "bob"] * 12))
    first = order[:18]  # while both have requests waiting: two of alice's to one of bob's
    assert abs(first.count("alice") - 12) <= 1, order


def test_past_its_share_of_the_measured_capacity_a_tenant_is_refused() -> None:
    async def refused(service_s: float, num_queued: int) -> bool:
        """Whether alice's next request is refused with ``num_queued`` of hers waiting
        longer than ``MAX_QUEUE_S``, once requests took ``service_s`` each."""
        sched, clock = scheduler(1, alice=1.0, bob=1.0)
        for _ in range(400):  # the capacity is measured from what requests took
            held = await sched.acquire("alice")
            assert isinstance(held, Held)
            clock.now += service_s
            sched.release(held)
        assert isinstance(await sched.acquire("alice"), Held)  # every slot is held
        waiting = [asyncio.ensure_future(sched.acquire("alice")) for _ in range(num_queued)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting), "queued, not refused, while it was young"
        clock.now += MAX_QUEUE_S * 1.5
        last = asyncio.ensure_future(sched.acquire("alice"))
        await asyncio.sleep(0)
        answer = last.result() if last.done() else None  # a refusal comes at once
        for w in [*waiting, last]:
            w.cancel()
        await asyncio.sleep(0)
        return isinstance(answer, float) and answer > 0

    # 20 queued: 2 s at 10 requests/s, 0.02 s at 1,000 requests/s.
    assert asyncio.run(refused(0.1, 20))
    assert not asyncio.run(refused(0.001, 20))
    assert not asyncio.run(refused(0.1, 5))


def test_a_waiter_that_goes_away_gives_its_place_and_slot_back() -> None:
    async def run() -> None:
        sched, clock = scheduler(1, alice=1.0, bob=1.0)
        held = await sched.acquire("alice")
        assert isinstance(held, Held)
        gone = asyncio.ensure_future(sched.acquire("bob"))
        waiting = asyncio.ensure_future(sched.acquire("alice"))
        await asyncio.sleep(0)
        gone.cancel()  # bob's client hung up while it waited
        await asyncio.sleep(0)
        sched.release(held)
        got = await asyncio.wait_for(waiting, 1)
        assert isinstance(got, Held) and got.tenant == "alice"
        sched.release(got)
        again = await sched.acquire("bob")  # every slot is free again
        assert isinstance(again, Held)

    asyncio.run(run())


def test_a_slot_is_kept_for_a_tenant_that_asked_lately() -> None:
    async def run() -> None:
        sched, clock = scheduler(2, alice=1.0, bob=1.0)
        first = [await sched.acquire("alice") for _ in range(2)]  # alone: every slot
        assert all(isinstance(h, Held) for h in first)
        for held in first:
            sched.release(held)  # type: ignore[arg-type]
        bob = await sched.acquire("bob")  # bob asks now and then
        assert isinstance(bob, Held)
        clock.now += 0.01
        sched.release(bob)
        alice = await sched.acquire("alice")
        assert isinstance(alice, Held)
        kept = asyncio.ensure_future(sched.acquire("alice"))
        await asyncio.sleep(0)
        assert not kept.done(), "alice took the slot kept for bob"
        again = await asyncio.wait_for(sched.acquire("bob"), 1)  # at once: the kept slot
        assert isinstance(again, Held) and not kept.done()
        clock.now += RESERVE_S  # bob quiet since: the slot he gives back is alice's
        sched.release(again)
        got = await asyncio.wait_for(kept, 1)
        assert isinstance(got, Held) and got.tenant == "alice"
        sched.release(alice)
        sched.release(got)

    asyncio.run(run())


def test_a_kept_slot_lapses_when_its_tenant_stops_asking() -> None:
    async def run() -> None:
        sched, clock = scheduler(2, alice=1.0, bob=1.0)
        bob = await sched.acquire("bob")
        assert isinstance(bob, Held)
        sched.release(bob)
        held = await sched.acquire("alice")
        assert isinstance(held, Held)
        waiting = asyncio.ensure_future(sched.acquire("alice"))
        await asyncio.sleep(0)
        assert not waiting.done()
        clock.now += RESERVE_S
        sched.release(held)  # the next slot given back goes to alice's waiting request
        got = await asyncio.wait_for(waiting, 1)
        assert isinstance(got, Held)
        both = await sched.acquire("alice")  # both slots hers again
        assert isinstance(both, Held)

    asyncio.run(run())
