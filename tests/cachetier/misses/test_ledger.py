"""The miss ledger: notes explained until forgotten, ages and times, a bounded table that
replaces a full set's oldest entry, no key ever explained by another's entry, the per-key and
batch paths agreeing, writers and readers on several threads, and its size at a million keys."""

from __future__ import annotations

import random
import threading

import pytest

from cachetier.misses import LEDGER_CAUSES, MissCause, MissLedger
from cachetier.misses.table import SMALL_BATCH, WAYS
from cachetier.primitives.keys import BlockHash


def _key(fp: int, row: int, tail: int = 0) -> BlockHash:
    """A key whose fingerprint (bytes 0..8) and set (bytes 8..16) a test chooses."""
    return BlockHash(fp.to_bytes(8, "little") + row.to_bytes(8, "little") + tail.to_bytes(16))


class Clock:
    """A clock a test moves by hand."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _random_keys(n: int, seed: int = 0) -> list[BlockHash]:
    rng = random.Random(seed)
    return [BlockHash(rng.randbytes(32)) for _ in range(n)]


def test_a_noted_key_is_explained_with_its_tier_and_age_until_forgotten() -> None:
    clock = Clock()
    ledger = MissLedger(64, clock=clock)
    ledger.note([_key(1, 0), _key(2, 1)], "evicted", "disk", stored_at=clock.now - 90)
    ledger.note([_key(3, 2)], "write_dropped", "redis")
    clock.now += 30
    got = ledger.explain([_key(1, 0), _key(3, 2), _key(4, 3)])
    assert got[0] == MissCause("evicted", "disk", got[0].age_s, "30 s ago")
    assert got[0].age_s == pytest.approx(90, rel=1e-3)  # a float16 of minutes
    assert got[1] == MissCause("write_dropped", "redis", None, "30 s ago")
    assert got[2] is None
    assert ledger.forget([_key(1, 0), _key(4, 3)]) == 1
    assert ledger.explain([_key(1, 0), _key(2, 1)]) == [None, got[0]]


def test_a_key_noted_again_takes_the_new_cause_in_its_old_place() -> None:
    ledger = MissLedger(8)
    ledger.note([_key(7, 0)], "not_admitted", "disk")
    ledger.note([_key(7, 0)], "corrupt", "cpu")
    (got,) = ledger.explain([_key(7, 0)])
    assert (got.cause, got.tier) == ("corrupt", "cpu")
    assert len(ledger) == 1


def test_every_ledger_cause_round_trips_and_stored_at_may_be_one_time_a_key() -> None:
    clock = Clock()
    ledger = MissLedger(1024, clock=clock)
    keys = [_key(i + 1, i) for i in range(len(LEDGER_CAUSES))]
    for key, cause in zip(keys, LEDGER_CAUSES):
        ledger.note([key], cause, f"tier-{cause}")
    assert [(c.cause, c.tier) for c in ledger.explain(keys)] == [
        (cause, f"tier-{cause}") for cause in LEDGER_CAUSES
    ]
    many = [_key(100 + i, 100 + i) for i in range(3 * SMALL_BATCH)]  # the batch path
    ledger.note(iter(many), "evicted", "disk", stored_at=[clock.now - 60 * i for i in range(24)])
    ages = [c.age_s for c in ledger.explain(many)]
    assert ages == pytest.approx([60.0 * i for i in range(24)], rel=1e-3)


def test_ages_are_clipped_to_what_the_ledger_can_say() -> None:
    clock = Clock(10**9)
    ledger = MissLedger(8, clock=clock)
    ledger.note([_key(1, 0)], "evicted", "disk", stored_at=0.0)  # decades ago
    ledger.note([_key(2, 0)], "evicted", "disk", stored_at=clock.now + 5)  # a clock stepped back
    old, future = ledger.explain([_key(1, 0), _key(2, 0)])
    assert old.age_s == pytest.approx(65504 * 60)  # float16's largest, in minutes
    assert future.age_s == 0.0


def test_a_full_set_replaces_its_oldest_entry_and_the_others_stay() -> None:
    ledger = MissLedger(2 * WAYS)  # two sets
    assert ledger.tracked_keys == 2 * WAYS
    first = [_key(i + 1, 0) for i in range(WAYS)]
    ledger.note(first, "evicted", "cpu")
    ledger.note([_key(99, 1)], "evicted", "cpu")  # the other set is untouched
    ledger.note([_key(50, 0)], "evicted", "disk")
    held = ledger.explain([*first, _key(50, 0), _key(99, 1)])
    assert [h is not None for h in held] == [False, True, True, True, True, True]
    ledger.note([_key(51, 0)], "evicted", "disk")  # then the next oldest
    assert ledger.explain([first[1]]) == [None]
    assert len(ledger) == WAYS + 1


def test_a_forgotten_way_is_filled_before_a_live_entry_is_replaced() -> None:
    ledger = MissLedger(WAYS)
    keys = [_key(i + 1, 0) for i in range(WAYS)]
    ledger.note(keys, "evicted", "cpu")
    ledger.forget([keys[2]])
    ledger.note([_key(77, 0)], "evicted", "cpu")
    assert [h is not None for h in ledger.explain([*keys, _key(77, 0)])] == [
        True,
        True,
        False,
        True,
        True,
    ]


def test_keys_sharing_a_fingerprint_or_a_set_are_told_apart() -> None:
    ledger = MissLedger(16 * WAYS)
    ledger.note([_key(5, 0)], "evicted", "cpu")
    ledger.note([_key(6, 0)], "corrupt", "disk")  # same set, another fingerprint
    assert ledger.explain([_key(5, 1), _key(5, 2)]) == [None, None]  # same fingerprint, other sets
    assert [c.cause for c in ledger.explain([_key(5, 0), _key(6, 0)])] == ["evicted", "corrupt"]


def test_only_all_64_fingerprint_bits_equal_in_one_set_can_confuse_two_keys() -> None:
    # The documented limit (2^-64 a way for digests): bytes 16..32 are not compared.
    ledger = MissLedger(8)
    ledger.note([_key(5, 0, tail=1)], "evicted", "cpu")
    assert ledger.explain([_key(5, 0, tail=2)])[0].cause == "evicted"


def test_colliding_random_keys_are_explained_by_their_own_entry_or_not_at_all() -> None:
    keys = _random_keys(4000)
    tiers = [f"t{i}" for i in range(200)]
    ledger = MissLedger(256)  # 4000 keys into 64 sets: almost every note replaces another
    want = {}
    rng = random.Random(1)
    for key in keys:
        cause, tier = rng.choice(LEDGER_CAUSES), rng.choice(tiers)
        ledger.note([key], cause, tier)
        want[key] = (cause, tier)
    got = ledger.explain(keys) + ledger.explain(keys[:5])
    kept = [(c.cause, c.tier) == want[k] for k, c in zip(keys, got) if c is not None]
    assert all(kept) and len(kept) == len(ledger) == 256
    assert ledger.explain(_random_keys(2000, seed=9)) == [None] * 2000


def test_the_batch_path_leaves_the_table_as_the_per_key_path_does() -> None:
    keys = _random_keys(3000, seed=3)
    keys += keys[::7]
    random.Random(4).shuffle(keys)  # keys noted twice, some within one batch
    per_key, batched = MissLedger(128, clock=Clock()), MissLedger(128, clock=Clock())
    for n, start in enumerate(range(0, len(keys), 100)):
        chunk, cause = keys[start : start + 100], LEDGER_CAUSES[n % 4]
        batched.note(chunk, cause, f"tier{n % 3}")
        for key in chunk:
            per_key.note([key], cause, f"tier{n % 3}")
    assert batched.explain(keys) == per_key.explain(keys)
    assert batched.explain(keys[:SMALL_BATCH]) == per_key.explain(keys[:SMALL_BATCH])
    assert batched.forget(keys[:500]) == sum(per_key.forget([k]) for k in keys[:500])
    assert batched.explain(keys) == per_key.explain(keys)
    assert len(batched) == len(per_key) > 0


def test_writers_and_readers_on_several_threads() -> None:
    ledger = MissLedger(1 << 14)
    # Each thread owns its sets, so nothing is replaced and every note must be found.
    per_thread = 2000
    owned = [
        [_key(t * per_thread + i + 1, t * per_thread + i) for i in range(per_thread)]
        for t in range(4)
    ]
    errors: list[BaseException] = []

    def write(t: int) -> None:
        try:
            for start in range(0, per_thread, 50):
                ledger.note(owned[t][start : start + 50], LEDGER_CAUSES[t], f"tier{t}")
                ledger.forget(owned[t][start : start + 3])
                ledger.note(owned[t][start : start + 3], LEDGER_CAUSES[t], f"tier{t}")
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            for _ in range(200):
                for t in range(4):
                    for got in ledger.explain(owned[t][::97]):
                        assert got is None or (got.cause, got.tier) == (
                            LEDGER_CAUSES[t],
                            f"tier{t}",
                        )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for t in range(4):
        assert [(c.cause, c.tier) for c in ledger.explain(owned[t])] == [
            (LEDGER_CAUSES[t], f"tier{t}")
        ] * per_thread


def test_its_memory_at_a_million_keys_is_the_docstring_formula() -> None:
    ledger = MissLedger(1_000_000)
    assert ledger.nbytes == 16 * 1_000_000 + 1_000_000 // WAYS == 16_250_000
    assert MissLedger(10).tracked_keys == 12  # rounded up to whole sets


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_a_bad_size_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="tracked_keys must be a positive int"):
        MissLedger(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("cause", ["never_stored", "namespace_mismatch", "lost"])
def test_a_cause_the_ledger_cannot_remember_is_refused(cause: str) -> None:
    with pytest.raises(ValueError, match="remembers only"):
        MissLedger(8).note([_key(1, 0)], cause, "disk")


@pytest.mark.parametrize("count", [1, SMALL_BATCH + 1])
def test_bad_notes_are_refused_and_write_nothing(count: int) -> None:
    ledger = MissLedger(64)
    keys = [_key(i + 1, i) for i in range(count)]
    with pytest.raises(ValueError, match="non-empty tier name"):
        ledger.note(keys, "evicted", "")
    with pytest.raises(ValueError, match="block key is 32 bytes"):
        ledger.note([*keys, BlockHash(b"short")], "evicted", "disk")
    with pytest.raises(ValueError, match=f"has 2 times for {count} keys"):
        ledger.note(keys, "evicted", "disk", stored_at=[1.0, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        ledger.note(keys, "evicted", "disk", stored_at=float("nan"))
    with pytest.raises(TypeError, match="stored_at must be"):
        ledger.note(keys, "evicted", "disk", stored_at=["x"] * count)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="block key is 32 bytes"):
        ledger.explain([BlockHash(b"short")] * count)
    assert len(ledger) == 0


def test_it_tells_at_most_256_tiers_apart() -> None:
    ledger = MissLedger(8)
    for i in range(256):
        ledger.note([_key(1, 0)], "evicted", f"t{i}")
    with pytest.raises(ValueError, match="at most 256 tiers"):
        ledger.note([_key(1, 0)], "evicted", "one-more")
