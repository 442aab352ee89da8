"""fp8 KV cache on SmolLM2: bytes per token, logit error and greedy agreement against fp32 KV.

    python -m benchmarks.fp8 --json [--tokens 1000] [--max-tokens 32] [--num-prompts 4]

The model computes in fp32 throughout; only the KV pool's dtype changes.

- ``kv_bytes_per_token``: pool (and tier payload) bytes per token for each KV dtype.
  ``kv_scale_bytes_per_token`` is what an fp8 block's scales add (its record's ``aux``).
- ``max_abs_logit_diff`` / ``mean_abs_logit_diff``, per fp8 format: |logits - fp32-KV logits|
  over the prompt's last position and the teacher-forced decode steps of the fp32 engine's
  greedy continuation (``max_tokens`` rows per prompt, every prompt, the whole vocabulary).
- ``top1_agreement``: fraction of those rows whose argmax equals the fp32-KV argmax.
- ``greedy_agreement``: fraction of the ``max_tokens`` greedy tokens of the engine, over all
  prompts, equal to the fp32-KV engine's token at the same position (a strict measure: after
  the first difference the continuations usually part ways). ``first_divergence`` gives, per
  prompt, the index of the first differing token (``max_tokens`` if none).
- ``fp32_margin_at_divergence``: per diverging prompt, the fp32 logit gap between its top two
  tokens where the fp8 run first picked another token (small: a near-tie flipped).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.support.output import emit
from benchmarks.support.timing import settle
from cachetier.engine.config import FP8_KV_DTYPES
from cachetier.engine.demo import STORY
from cachetier.engine.kv_cache import KVPool
from cachetier.engine.llm import LLM
from cachetier.engine.model import ForwardBatch, LlamaModel, SeqSlice
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.smollm2 import smollm2_path
from cachetier.engine.weights import load_weights

BLOCK_SIZE = 16
QUESTIONS = (
    "Summarise the ledger in one sentence.",
    "Which flags appear in the ledger? Answer with a list.",
    "Write a short poem about the lighthouse keeper.",
    "What would you ask the keeper about the ships, and why?",
)


def build_prompts(llm: LLM, num_tokens: int, num_prompts: int) -> list[list[int]]:
    """Chat prompts of about ``num_tokens`` tokens: the same long ledger, different questions."""

    def prompts(pages: int) -> list[list[int]]:
        body = "".join(STORY.replace("ledger", f"ledger (page {p})") for p in range(pages))
        return [llm.encode(f"{body}\n{q}", chat=True) for q in QUESTIONS[:num_prompts]]

    # Measure one page and eleven (template and question included), then take what fits.
    one, eleven = len(prompts(1)[0]), len(prompts(11)[0])
    return prompts(max(1, 1 + round((num_tokens - one) * 10 / (eleven - one))))


def teacher_forced_logits(
    model: LlamaModel, spec: ModelSpec, prompt: list[int], continuation: list[int], dtype: str
) -> torch.Tensor:
    """Logits of the prompt's last token, then of each decode step fed ``continuation[:-1]``.

    Returns:
        ``[len(continuation), vocab]`` float32.
    """
    tokens = prompt + continuation[:-1]
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    # An fp32 block's bytes bound every dtype's (fp8 payload and scales included).
    fp32_block_bytes = 2 * spec.num_layers * BLOCK_SIZE * spec.num_kv_heads * spec.head_dim * 4
    pool = KVPool(spec, BLOCK_SIZE, (num_blocks + 1) * fp32_block_bytes, dtype)
    table = torch.arange(num_blocks)
    rows = []
    start = 0
    for n in [len(prompt)] + [1] * (len(continuation) - 1):
        pos = torch.arange(start, start + n)
        ctx = start + n
        batch = ForwardBatch(
            torch.tensor(tokens[start:ctx]),
            pos,
            table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE,
            (SeqSlice(0, n, ctx, table[: -(-ctx // BLOCK_SIZE)]),),
            torch.tensor([n - 1]),
        )
        rows.append(model.forward(batch, pool.cache, kv_scales=pool.scales))
        start = ctx
    return torch.cat(rows)


def kv_bytes(spec: ModelSpec) -> dict[str, dict[str, float]]:
    """Pool bytes per token of each KV dtype, and what an fp8 block's scales add."""
    kv_dtypes = {"fp32": "float32", "bf16": "bfloat16"} | FP8_KV_DTYPES
    pools = {name: KVPool(spec, BLOCK_SIZE, 1 << 24, dtype) for name, dtype in kv_dtypes.items()}
    return {
        "kv_bytes_per_token": {n: p.block_bytes / BLOCK_SIZE for n, p in pools.items()},
        "kv_scale_bytes_per_token": {n: p.aux_bytes / BLOCK_SIZE for n, p in pools.items()},
    }


def greedy_outputs(
    folder: Path, args: argparse.Namespace
) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """The prompts, and each KV dtype's greedy tokens for them (fp32 and every fp8 format),
    one engine at a time."""
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for name in ("fp32", *FP8_KV_DTYPES):
        kv_cache_dtype = "auto" if name == "fp32" else name
        llm = LLM(folder, kv_cache_bytes=512 << 20, kv_cache_dtype=kv_cache_dtype)
        if not prompts:
            prompts = build_prompts(llm, args.tokens, args.num_prompts)
        outputs[name] = [o.token_ids for o in llm.generate(prompts, greedy)]
        del llm
        settle()
    return prompts, outputs


def first_divergence(reference: list[list[int]], got: list[list[int]]) -> list[int]:
    """Per prompt, the index of its first token other than the reference's (its length if none)."""
    return [
        next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
        for r, o in zip(reference, got)
    ]


def compare(
    folder: Path, spec: ModelSpec, prompts: list[list[int]], outputs: dict[str, list[list[int]]]
) -> dict[str, Any]:
    """Every fp8 format against fp32 KV: logit errors and top-1 agreement on the fp32 run's
    teacher-forced continuation, greedy agreement, and the fp32 margin where each diverged."""
    reference = outputs["fp32"]
    total = sum(len(t) for t in reference)
    model = LlamaModel(spec, load_weights(folder), torch.float32)
    ref_logits = [
        teacher_forced_logits(model, spec, p, c, "float32") for p, c in zip(prompts, reference)
    ]
    figures: dict[str, dict[str, Any]] = {
        key: {}
        for key in (
            "max_abs_logit_diff",
            "mean_abs_logit_diff",
            "top1_agreement",
            "greedy_agreement",
            "first_divergence",
            "fp32_margin_at_divergence",
        )
    }
    for name, dtype in FP8_KV_DTYPES.items():
        diffs, same = [], []
        for p, c, ref in zip(prompts, reference, ref_logits):
            got = teacher_forced_logits(model, spec, p, c, dtype)
            diffs.append((got - ref).abs())
            same.append(got.argmax(-1) == ref.argmax(-1))
        d = torch.cat(diffs)
        figures["max_abs_logit_diff"][name] = d.max().item()
        figures["mean_abs_logit_diff"][name] = d.mean().item()
        figures["top1_agreement"][name] = torch.cat(same).float().mean().item()
        pairs = zip(reference, outputs[name])
        figures["greedy_agreement"][name] = (
            sum(a == b for r, o in pairs for a, b in zip(r, o)) / total
        )
        divergence = first_divergence(reference, outputs[name])
        figures["first_divergence"][name] = divergence
        margins = []
        for ref, i in zip(ref_logits, divergence):
            if i < len(ref):
                top2 = ref[i].topk(2).values
                margins.append((top2[0] - top2[1]).item())
        figures["fp32_margin_at_divergence"][name] = margins
    return {**figures, "fp32_mean_abs_logit": torch.cat(ref_logits).abs().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length (about)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--num-prompts", type=int, default=len(QUESTIONS))
    args = parser.parse_args()
    if not 1 <= args.num_prompts <= len(QUESTIONS):
        parser.error(f"--num-prompts must be in [1, {len(QUESTIONS)}]")

    folder = smollm2_path()
    spec = ModelSpec.from_folder(folder)
    result: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        **kv_bytes(spec),
    }
    prompts, outputs = greedy_outputs(folder, args)
    result["prompt_tokens"] = [len(p) for p in prompts]
    figures = compare(folder, spec, prompts, outputs)
    result.update(figures)
    for name in FP8_KV_DTYPES:
        print(
            f"{name}: max |dlogit| {figures['max_abs_logit_diff'][name]:.3f}, "
            f"mean {figures['mean_abs_logit_diff'][name]:.4f}, "
            f"top-1 {figures['top1_agreement'][name]:.3f}, "
            f"greedy {figures['greedy_agreement'][name]:.3f}, "
            f"first divergence {figures['first_divergence'][name]}",
            file=sys.stderr if args.json else sys.stdout,
        )
    emit(result, args.json)


if __name__ == "__main__":
    main()
