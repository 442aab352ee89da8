"""The restore guard's measure, sampling and quarantine list.

Blocks here are torch tensors cast to each dtype: an honest record differs from its
recomputation by rounding only, and each forgery (K and V swapped, another arrangement labelled
canonical, other values) by about its own size. The forgeries computed by real models are
checked through the engine (tests/engine/test_guard_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from cachetier.errors import QuarantineLimitError
from cachetier.guard import (
    REL_TOLERANCE,
    GuardConfig,
    GuardSampler,
    QuarantineList,
    compare_blocks,
)
from cachetier.guard.compare import _fp8_table, relative_errors
from cachetier.primitives.keys import dtype_name
from cachetier.record import KVBlock

KEY = bytes(range(32))
FINGERPRINT = bytes(32)
SHAPE = (4, 2, 16, 3, 8)  # [layers, K/V, tokens, kv_heads, head_dim]


def _block(values: torch.Tensor, dtype: torch.dtype, aux: bytes = b"") -> KVBlock:
    data = values.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
    return KVBlock(KEY, FINGERPRINT, dtype_name(dtype), tuple(values.shape), SHAPE[2], data, aux)


def _kv(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * 3


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_honest_record_is_within_tolerance(dtype: torch.dtype) -> None:
    kv = _kv()
    # Another order of sums: a relative perturbation far above float rounding.
    recomputed = kv * (1 + 1e-3 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(9)))
    assert compare_blocks(_block(kv, dtype), _block(recomputed, dtype)) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_and_v_swapped_are_caught_in_every_layer(dtype: torch.dtype) -> None:
    kv = _kv()
    swapped = kv.flip(1)
    found = compare_blocks(_block(swapped, dtype), _block(kv, dtype))
    assert found is not None and found.reason == "values"
    assert found.max_rel_error > 1.0
    assert {(layer, plane) for layer, plane, _ in found.worst} == {
        (layer, plane) for layer in range(SHAPE[0]) for plane in ("K", "V")
    }
    assert "layer" in found.describe() and dtype_name(dtype) in found.describe()


def test_another_arrangement_labelled_canonical_is_caught() -> None:
    kv = _kv()
    # [layers, tokens, K/V, heads, dim] bytes under the canonical shape.
    other = kv.permute(0, 2, 1, 3, 4).contiguous().reshape(SHAPE)
    found = compare_blocks(_block(other, torch.float32), _block(kv, torch.float32))
    assert found is not None and found.max_rel_error > 0.5


def test_other_values_are_caught_and_one_bad_layer_is_named() -> None:
    kv = _kv()
    forged = kv.clone()
    forged[2, 1] = _kv(seed=5)[2, 1]  # layer 2's V from other tokens
    found = compare_blocks(_block(forged, torch.bfloat16), _block(kv, torch.bfloat16))
    assert found is not None
    assert [(layer, plane) for layer, plane, _ in found.worst] == [(2, "V")]


def test_a_nan_is_a_mismatch() -> None:
    kv = _kv()
    broken = kv.clone()
    broken[0, 0, 0, 0, 0] = float("nan")
    found = compare_blocks(_block(broken, torch.float32), _block(kv, torch.float32))
    assert found is not None and found.max_rel_error == float("inf")


def test_shape_and_dtype_differences_are_mismatches() -> None:
    kv = _kv()
    computed = _block(kv, torch.float32)
    other_dtype = compare_blocks(_block(kv, torch.float16), computed)
    assert other_dtype is not None and other_dtype.reason == "dtype"
    short = _block(kv[:3], torch.float32)
    assert compare_blocks(short, computed).reason == "shape"


def test_a_dtype_without_a_tolerance_is_refused() -> None:
    kv = torch.zeros(SHAPE, dtype=torch.uint8)
    block = KVBlock(KEY, FINGERPRINT, "uint8", SHAPE, SHAPE[2], kv.numpy().tobytes())
    with pytest.raises(ValueError, match="uint8"):
        compare_blocks(block, block)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_values_decode_as_torch_decodes_them(name: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(getattr(torch, name)).to(torch.float64).numpy()
    got = _fp8_table(name)
    assert ((got == want) | (torch.isnan(torch.from_numpy(want)).numpy() & (got != got))).all()


def test_fp8_records_are_compared_after_their_scales() -> None:
    kv = _kv()
    scales = kv.abs().amax(dim=(2, 3, 4)) / 448  # [layers, 2], as the engine's fp8 pool
    quantised = (kv / scales[:, :, None, None, None]).to(torch.float8_e4m3fn)
    aux = scales.to(torch.float32).numpy().tobytes()
    restored = KVBlock(
        KEY,
        FINGERPRINT,
        "float8_e4m3fn",
        SHAPE,
        SHAPE[2],
        quantised.view(torch.uint8).numpy().tobytes(),
        aux,
    )
    errors = relative_errors(restored, _block(kv, torch.float32))
    assert errors.max() < REL_TOLERANCE["float8_e4m3fn"]
    swapped_scales = scales.flip(1).to(torch.float32).numpy().tobytes()
    forged = KVBlock(
        KEY,
        FINGERPRINT,
        "float8_e4m3fn",
        SHAPE,
        SHAPE[2],
        quantised.view(torch.uint8).numpy().tobytes(),
        swapped_scales,
    )
    assert relative_errors(forged, _block(kv, torch.float32)).max() > 0.1


def test_the_first_hits_of_each_tier_and_namespace_are_verified_then_a_fraction() -> None:
    sampler = GuardSampler(GuardConfig(first_hits=2, fraction=0.0))
    draws = [sampler.should_verify("disk", "ns-a") for _ in range(4)]
    assert draws == [True, True, False, False]
    assert sampler.should_verify("redis", "ns-a") and sampler.should_verify("disk", "ns-b")
    every = GuardSampler(GuardConfig(first_hits=0, fraction=1.0))
    assert all(every.should_verify("disk", "ns") for _ in range(5))
    draws = [
        [s.should_verify("cpu", "n") for _ in range(40)]
        for s in (GuardSampler(GuardConfig(first_hits=0, fraction=0.5, seed=3)) for _ in range(2))
    ]
    assert draws[0] == draws[1] and 5 < sum(draws[0]) < 35


def test_the_first_hits_of_each_writer_are_verified_and_a_clean_draw_counts_for_it() -> None:
    sampler = GuardSampler(GuardConfig(first_hits=2, fraction=1.0))
    draws = [sampler.should_verify_writer("disk", "ns", "w1") for _ in range(3)]
    assert draws == [True, True, False]  # later hits are the namespace draw's (fraction)
    assert sampler.should_verify_writer("disk", "ns", "w2")  # a new writer: checked first
    assert sampler.should_verify_writer("cpu", "ns", "w1")  # and in another tier
    sampler.credit_writer("disk", "ns", "w3")  # a namespace draw found w3's records clean
    sampler.credit_writer("disk", "ns", "w3")
    assert not sampler.should_verify_writer("disk", "ns", "w3")
    off = GuardSampler(GuardConfig(enabled=False))
    assert not off.should_verify_writer("disk", "ns", "w1")


def test_a_guard_turned_off_verifies_nothing() -> None:
    sampler = GuardSampler(GuardConfig(enabled=False))
    assert not any(sampler.should_verify("disk", "ns") for _ in range(10))


@pytest.mark.parametrize(
    "kwargs", [{"first_hits": -1}, {"first_hits": True}, {"fraction": 1.5}, {"enabled": "yes"}]
)
def test_bad_guard_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GuardConfig(**kwargs)


def test_a_quarantine_holds_one_namespace_of_one_tier_until_lifted() -> None:
    held = QuarantineList()
    assert held.add("disk", "ns-a", "layer 0 K")
    assert not held.add("disk", "ns-a", "again")  # the first reason is kept
    assert held.holds("disk", "ns-a")
    assert not held.holds("redis", "ns-a") and not held.holds("disk", "ns-b")
    held.add("redis", "ns-a", "layer 1 V")
    assert held.tiers_of("ns-a") == {"disk", "redis"}
    assert [q.reason for q in held.entries()] == ["layer 0 K", "layer 1 V"]
    assert [q.tier for q in held.lift("ns-a", tier="redis")] == ["redis"]
    assert held.tiers_of("ns-a") == {"disk"}
    assert [q.tier for q in held.lift("ns-a")] == ["disk"]
    assert held.entries() == []


def test_a_writers_quarantine_holds_back_that_writer_only() -> None:
    held = QuarantineList()
    assert held.add("disk", "ns", "layer 0 K", writer="bad")
    assert held.holds_writer("disk", "ns", "bad")
    assert not held.holds_writer("disk", "ns", "good") and not held.holds_writer("cpu", "ns", "bad")
    assert not held.holds("disk", "ns") and held.tiers_of("ns") == frozenset()  # not all
    assert [q.writer for q in held.entries()] == ["bad"]
    held.add("disk", "ns", "operator")  # the whole namespace: every writer
    assert held.holds_writer("disk", "ns", "good") and held.holds("disk", "ns")
    assert {q.writer for q in held.lift("ns")} == {"bad", ""}
    assert not held.holds_writer("disk", "ns", "bad")


def test_a_full_quarantine_list_refuses_new_entries_by_name() -> None:
    held = QuarantineList(max_entries=2)
    held.add("disk", "a", "x")
    held.add("disk", "b", "x")
    assert not held.add("disk", "a", "again")  # a held one is no new entry
    with pytest.raises(QuarantineLimitError, match="max_entries"):
        held.add("disk", "c", "x")
    held.lift("a")
    assert held.add("disk", "c", "x")
