"""The engine's forward equals transformers' forward, whole or in chunks over the paged pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachetier.engine.model import LlamaModel, SeqSlice, _decode_groups
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.weights import load_weights
from tests.engine.pool_forward import pool_logits
from tests.models import make_tiny_llama

BLOCK = 16


def _engine_logits(folder: Path, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    model = LlamaModel(ModelSpec.from_folder(folder), load_weights(folder), torch.float32)
    return pool_logits(model, tokens, chunks, pool_bytes=1 << 26)[0]


def _hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize(
    "chunks", [[100], [37, 1, 62], [16, 16, 16, 52], [1] * 5 + [95], [30, 70], [64, 36]]
)
def test_tiny_logits_match_transformers(tiny_model_dir: Path, chunks: list[int]) -> None:
    tokens = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _engine_logits(tiny_model_dir, tokens, chunks)
    torch.testing.assert_close(ours, _hf_logits(tiny_model_dir, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[100], [80, 20]])
def test_sdpa_with_kv_repeated_per_query_head_matches_transformers(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[int]
) -> None:
    # The form CUDA takes (cachetier.engine.model._EXPAND_GQA_DEVICES), run here on the CPU.
    import cachetier.engine.model

    monkeypatch.setattr(cachetier.engine.model, "_EXPAND_GQA_DEVICES", ("cpu",))
    calls = []
    real = cachetier.engine.model.F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> object:
        calls.append((q.shape[1], k.shape[1], kwargs["enable_gqa"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(cachetier.engine.model.F, "scaled_dot_product_attention", recording)
    tokens = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _engine_logits(tiny_model_dir, tokens, chunks)
    assert calls and all(c == (4, 4, False) for c in calls), calls  # 4 query heads, 2 KV heads
    torch.testing.assert_close(ours, _hf_logits(tiny_model_dir, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "chunks", [[200], [40, 160], [130, 5, 65], [64, 64, 64, 8], [1], [600, 3, 1, 7]]
)
def test_native_prefill_logits_match_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[int]
) -> None:
    # head_dim 64: the shapes cachetier.kernels.native_prefill_attention takes (the tiny model
    # above, head_dim 16, never does). Wide chunks, narrow ones beside them, and a few tokens after
    # 600 cached, whose keys the kernel splits between tasks.
    import cachetier.engine.model

    folder = make_tiny_llama(tmp_path, hidden_size=256, num_heads=4, num_kv_heads=2)
    ran = []
    real = cachetier.engine.model.paged_prefill_attention

    def counting(*args: object, **kwargs: object) -> bool:
        ran.append(real(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(cachetier.engine.model, "paged_prefill_attention", counting)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (sum(chunks),), generator=gen).tolist()

    ours = _engine_logits(folder, tokens, chunks)

    assert ran and all(ran), "the native prefill kernel did not run"
    torch.testing.assert_close(ours, _hf_logits(folder, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.model
def test_smollm2_logits_match_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tokens = tok.encode("The capital of France is Paris. The capital of Italy is Rome. " * 8)
    ours = _engine_logits(smollm2_dir, tokens, [len(tokens) - 40, 24, 1, 15])
    # fp32 through 30 layers, summed in another order by each CPU's GEMM kernels: on CPUs with
    # AVX-512 ours and transformers differ by about 1e-4 (logits reach 35), as transformers
    # does against itself on another thread count. A wrong block, position or head moves
    # logits by whole units.
    torch.testing.assert_close(ours, _hf_logits(smollm2_dir, tokens), atol=3e-4, rtol=1e-4)


def test_decodes_are_grouped_by_their_shared_leading_blocks() -> None:
    def decode(row: int, table: list[int], context_len: int) -> SeqSlice:
        return SeqSlice(row, 1, context_len, torch.tensor(table))

    decodes = [
        decode(0, [3, 4, 5], 40),
        decode(1, [7, 8], 20),
        decode(2, [3, 4, 6], 35),
        decode(3, [3, 4], 32),  # ends at the end of block 4: both shared blocks are full
        decode(4, [9, 10], 30),
        decode(5, [11], 10),  # shares block 11 with row 6, but neither holds it full
        decode(6, [11], 12),
    ]
    groups = _decode_groups(decodes, 16, torch.device("cpu"), fp8=False)
    # Rows that share no full block with another go into one call together.
    assert [g.rows.tolist() for g in groups] == [[0, 2, 3], [1, 4, 5, 6]]
    assert [g.num_shared_blocks for g in groups] == [2, 0]
    assert groups[0].tables.tolist() == [[3, 4, 5], [3, 4, 6], [3, 4, 0]]
    assert groups[1].tables.tolist() == [[7, 8], [9, 10], [11, 0], [11, 0]]
    assert groups[1].context_lens.tolist() == [20, 30, 10, 12]
    # fp8 dequantises per row: one group, nothing shared.
    (fp8,) = _decode_groups(decodes, 16, torch.device("cpu"), fp8=True)
    assert fp8.rows.tolist() == [0, 1, 2, 3, 4, 5, 6] and fp8.num_shared_blocks == 0
