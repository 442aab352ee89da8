"""The per-record check: the first layer's K and V of a record's tokens, recomputed from the
model folder, against what transformers caches and against forged records."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.support.forgeries import noise
from cachetier.guard.compare import REL_TOLERANCE
from cachetier.guard.first_layer import FirstLayer, rope_inv_freq
from cachetier.guard.record_check import FIRST_LAYER_TOLERANCE, RecordCheck
from tests.cachetier.guard_records import (
    BLOCK,
    DEEP_LAYER_FORGERY,
    FIRST_LAYER_FORGERIES,
    forged,
    model_kv,
    records_of,
)

TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, 256, size=4 * BLOCK)]


@pytest.fixture(scope="module")
def kv(tiny_model_dir: Path) -> np.ndarray:
    return model_kv(tiny_model_dir, TOKENS)


@pytest.fixture(scope="module")
def check(tiny_model_dir: Path) -> RecordCheck:
    return RecordCheck(FirstLayer.from_folder(tiny_model_dir), seed=1)


def test_the_first_layer_is_what_transformers_caches(tiny_model_dir: Path, kv: np.ndarray) -> None:
    layer = FirstLayer.from_folder(tiny_model_dir)
    got = layer.kv(torch.tensor(TOKENS), torch.arange(len(TOKENS))).numpy()
    np.testing.assert_allclose(got, kv[0], rtol=1e-5, atol=1e-5)
    # At other positions only K moves (RoPE): V is the token's alone.
    shifted = layer.kv(torch.tensor(TOKENS), torch.arange(len(TOKENS)) + 100).numpy()
    np.testing.assert_allclose(shifted[1], kv[0][1], rtol=1e-6)
    assert not np.allclose(shifted[0], kv[0][0], atol=1e-3)


def test_honest_records_pass(check: RecordCheck, kv: np.ndarray) -> None:
    records = records_of(kv, TOKENS)
    assert check.first_failure(records, TOKENS, 0) is None
    # The same records at the wrong place in the sequence are not the KV of those positions.
    failure = check.first_failure(records[1:], TOKENS[BLOCK:], 0)
    assert failure is not None and failure.index == 0


@pytest.mark.parametrize("name", sorted(FIRST_LAYER_FORGERIES))
def test_a_forgery_of_the_first_layer_is_caught_at_its_record(
    check: RecordCheck, kv: np.ndarray, name: str
) -> None:
    records = records_of(kv, TOKENS)
    records[2] = forged(records[2], FIRST_LAYER_FORGERIES[name])
    failure = check.first_failure(records, TOKENS, 0)
    assert failure is not None and failure.index == 2
    assert failure.mismatch.worst[0][0] == 0  # layer 0 is what it saw
    assert failure.mismatch.max_rel_error > 0.1


def test_another_prompts_kv_under_these_tokens_is_caught(
    tiny_model_dir: Path, check: RecordCheck, kv: np.ndarray
) -> None:
    other_tokens = [(t + 1) % 256 for t in TOKENS]
    other = records_of(model_kv(tiny_model_dir, other_tokens), other_tokens)
    records = records_of(kv, TOKENS)
    # The other prompt's record under this prompt's key: its checks pass, its content is not.
    records[1] = forged(other[1], lambda v: v)
    failure = check.first_failure(records, TOKENS, 0)
    assert failure is not None and failure.index == 1


def test_a_deeper_layer_forgery_is_not_seen_here(check: RecordCheck, kv: np.ndarray) -> None:
    # The documented limit: only the first layer is recomputed.
    records = records_of(kv, TOKENS)
    records[0] = forged(records[0], DEEP_LAYER_FORGERY)
    assert check.first_failure(records, TOKENS, 0) is None


def test_noise_a_full_verification_lets_pass_is_refused_here(
    check: RecordCheck, kv: np.ndarray
) -> None:
    # Half a full verification's fp32 tolerance in every layer: within what rounding grown
    # through every layer may do, but not what one projection's rounding does to layer 0.
    records = records_of(kv, TOKENS)
    loud = REL_TOLERANCE["float32"] / 2
    records[1] = forged(records[1], lambda v: noise(v, loud))
    failure = check.first_failure(records, TOKENS, 0)
    assert failure is not None and failure.index == 1
    assert failure.mismatch.tolerance == FIRST_LAYER_TOLERANCE["float32"]
    quiet = FIRST_LAYER_TOLERANCE["float32"] / 4
    records[1] = forged(records_of(kv, TOKENS)[1], lambda v: noise(v, quiet))
    assert check.first_failure(records, TOKENS, 0) is None


def test_k_may_drift_with_its_position_as_writers_rotary_angles_do(
    tiny_model_dir: Path, check: RecordCheck
) -> None:
    # A writer whose inverse frequencies are an fp32 ulp off ours (another formula, fp64
    # angles): far into a sequence its K differs by more than the fp32 tolerance, honestly.
    ours = FirstLayer.from_folder(tiny_model_dir)
    drifted = ours.inv_freq.clone()
    drifted[1:] = torch.nextafter(drifted[1:], torch.full_like(drifted[1:], 2.0))
    theirs = replace(ours, inv_freq=drifted, _table=[None])
    far = 400_000
    ids, positions = torch.tensor(TOKENS), torch.arange(len(TOKENS)) + far
    kv = theirs.kv(ids, positions).numpy()[None]  # [1 layer, 2, tokens, heads, dim]
    expected = ours.kv(ids, positions).numpy()
    k_error = np.linalg.norm(kv[0, 0] - expected[0]) / np.linalg.norm(expected[0])
    assert k_error > FIRST_LAYER_TOLERANCE["float32"]  # past the tolerance at position 0
    records = records_of(kv, TOKENS)
    assert check.first_failure(records, TOKENS, far) is None
    # The drift grows K's tolerance, not V's: V is never rotated.
    loud = REL_TOLERANCE["float32"] / 2

    def noisy_v(v: np.ndarray) -> np.ndarray:
        v[:, 1] = noise(v[:, 1:2], loud)[:, 0]
        return v

    records[0] = forged(records[0], noisy_v)
    failure = check.first_failure(records, TOKENS, far)
    assert failure is not None and [w[1] for w in failure.mismatch.worst] == ["V"]


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to TF32's 10-bit mantissa, as a GPU's TF32 matmul reads it."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def test_a_writer_that_multiplied_in_tf32_passes(tiny_model_dir: Path, check: RecordCheck) -> None:
    # fp32 records from a GPU whose matmuls read their inputs as TF32: honest, if rounder.
    layer = FirstLayer.from_folder(tiny_model_dir)
    ids, positions = torch.tensor(TOKENS), torch.arange(len(TOKENS))
    x = layer.embed[ids].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.norm
    kv = torch.nn.functional.linear(_tf32(x), _tf32(layer.kv_proj), layer.kv_bias)
    n, heads, dim = len(TOKENS), layer.num_kv_heads, layer.head_dim
    k, v = kv[:, : heads * dim].view(n, heads, dim), kv[:, heads * dim :].view(n, heads, dim)
    angles = positions.float()[:, None] * layer.inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    k1, k2 = k[..., : dim // 2], k[..., dim // 2 :]
    k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    theirs = torch.stack([k, v])[None].numpy()  # [1 layer, 2, tokens, heads, dim]
    exact = layer.kv(ids, positions).numpy()
    assert np.abs(theirs[0] - exact).max() > 0  # rounder than ours, not the same
    assert check.first_failure(records_of(theirs, TOKENS), TOKENS, 0) is None


def test_bfloat16_records_pass_within_their_tolerance(check: RecordCheck, kv: np.ndarray) -> None:
    records = records_of(kv, TOKENS)
    wide = np.frombuffer(records[0].data, dtype=np.float32).copy()
    narrow = (torch.from_numpy(wide).to(torch.bfloat16).view(torch.int16).numpy()).tobytes()
    record = records[0]
    bf16 = type(record)(
        record.key, record.fingerprint, "bfloat16", record.shape, record.num_tokens, narrow
    )
    assert check.first_failure([bf16], TOKENS, 0) is None


def test_records_it_cannot_read_are_passed_over(check: RecordCheck, kv: np.ndarray) -> None:
    records = records_of(kv, TOKENS)
    assert check.first_failure(records, TOKENS[:BLOCK], 0) is None  # tokens missing: no check
    assert check.first_failure(records[:1], [999] * BLOCK, 0) is None  # past the vocabulary


def test_only_the_scaling_kinds_the_engine_knows_are_taken() -> None:
    plain = rope_inv_freq(64, 10000.0, None)
    assert plain.shape == (32,)
    linear = rope_inv_freq(64, 10000.0, {"rope_type": "linear", "factor": 2.0})
    torch.testing.assert_close(linear, plain / 2)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_records_gathered_at_once_are_judged_alike(check: RecordCheck, kv: np.ndarray) -> None:
    # An engine's pool holds the records read in place: their first layer in one gather.
    records = records_of(kv, TOKENS)
    records[3] = forged(records[3], FIRST_LAYER_FORGERIES["k_and_v_swapped"])
    held = np.stack([np.frombuffer(r.data, np.float32).reshape(r.shape) for r in records])

    def layer0(offsets: np.ndarray, count: int) -> np.ndarray:
        got = held[:count, 0][:, :, offsets]  # [count, 2, k, H, D]
        return got.transpose(1, 0, 2, 3, 4).reshape(2, count * len(offsets), -1)

    failure = check.first_failure(records, TOKENS, 0, layer0)
    assert failure is not None and failure.index == 3
    assert check.first_failure(records[:3], TOKENS, 0, layer0) is None


@pytest.mark.parametrize(
    "family",
    [
        {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]},
        {"model_type": "qwen3"},
        {"architectures": ["Qwen3ForCausalLM"]},
    ],
)
def test_a_model_of_another_family_is_refused_by_name(tiny_model_dir: Path, family: dict) -> None:
    # Its first layer is not Llama's: a check by Llama's would call its honest records forged.
    import json

    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.pop("model_type", None)
    config.pop("architectures", None)
    weights = FirstLayer.from_folder(tiny_model_dir)  # the folder itself is Llama's: accepted
    assert weights.head_dim > 0
    name = family.get("model_type") or family["architectures"][0]
    with pytest.raises(ValueError, match=f"not '{name}'.*record_check off"):
        FirstLayer.from_tensors({**config, **family}, lambda _: torch.zeros(1))
    # A config naming no family at all (an engine's own, checked by its loader) passes on.
    assert FirstLayer.from_tensors(config, _tensors_of(tiny_model_dir)).head_dim == weights.head_dim


def _tensors_of(folder: Path):
    from safetensors.torch import load_file

    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors.get
