"""What one forward step costs, by new tokens and cached context: what the cost model fits.

The cost model (``cachetier.store.costmodel.PrefillModel``) prices a step as ``c0 + c1 x tokens +
c2 x attention``. Where that shape is wrong, its plans are too: on a fast GPU every step of
the 135M-parameter SmolLM2 costs about the same host time whatever its size, so a warm-up fit
sees tokens as almost free. This times single forwards of the engine's model (no scheduler, no
tiers) at the shapes a restart meets, in one process:

- ``forward_ms``: median milliseconds of one forward of ``n`` new tokens after ``c`` cached
  (``n@c``), its K/V written nowhere (slot -1, as the engine's warm-up does);
- ``attention_ms``: SDPA alone at three prefill shapes, causal bottom-right as the model now
  calls it (``lower_right``) against the explicit ``[n, context]`` mask it replaced
  (``mask``), and the largest difference of their outputs (``max_diff``);
- ``warm_up_fit``: the ``(c0, c1, c2)`` the engine's warm-up steps alone give, and what that
  fit predicts for each timed forward (``predicted_ms``), so a wrong shape shows as a gap.

    python -m benchmarks.steps --json [--device cuda] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.support.output import emit

# (new tokens, cached tokens): the warm-up's sizes, a chunk budget's, a whole 4k prompt, the
# same prompt after one restored block, a chunk after half of it, and a pool hit's suffix.
SHAPES: tuple[tuple[int, int], ...] = (
    (1, 0),
    (17, 0),
    (64, 0),
    (256, 0),
    (1024, 0),
    (4111, 0),
    (4095, 16),
    (2048, 2048),
    (15, 4096),
    (64, 4096),
)
ATTENTION_SHAPES: tuple[tuple[int, int], ...] = ((4095, 4111), (2048, 4096), (4111, 4111))


def _median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def attention_ms(
    device: str, repeats: int, shapes: tuple[tuple[int, int], ...] = ATTENTION_SHAPES
) -> dict[str, float]:
    """SDPA with the bottom-right causal bias against the explicit mask, fp32, 9 heads of 64
    (SmolLM2's query heads, K/V already repeated as the model does on CUDA)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    for n, ctx in shapes:
        q = torch.randn(1, 9, n, 64, device=dev)
        k, v = torch.randn(1, 9, ctx, 64, device=dev), torch.randn(1, 9, ctx, 64, device=dev)
        rows = torch.arange(n, device=dev)[:, None] + (ctx - n)
        mask = torch.arange(ctx, device=dev)[None, :] <= rows

        masked = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
        bias = causal_lower_right(n, ctx)
        lower_right = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=bias)
        out[f"mask_{n}@{ctx}"] = _median_ms(masked, repeats, sync)
        out[f"lower_right_{n}@{ctx}"] = _median_ms(lower_right, repeats, sync)
        out[f"max_diff_{n}@{ctx}"] = float((masked() - lower_right()).abs().max())
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cachetier.engine.llm import LLM
    from cachetier.engine.model import ForwardBatch, SeqSlice
    from cachetier.engine.smollm2 import smollm2_path
    from cachetier.store.costmodel import PrefillModel

    shapes = [tuple(int(x) for x in s.split("@")) for s in args.shapes] if args.shapes else SHAPES
    longest = max(n + c for n, c in shapes)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with LLM(
        args.model or smollm2_path(),
        kv_cache_bytes=1 << 30,
        max_num_batched_tokens=longest + 64,
        device=args.device,
    ) as llm:
        engine = llm.engine
        model, cache, scales = engine.model, engine.pool.cache, engine.pool.scales
        block_size, num_blocks = cache.shape[3], cache.shape[0]
        # What the engine's own warm-up taught its prefill model, before any request.
        fit = engine.prefill_model.coefficients

        def forward(n: int, cached: int) -> Callable[[], object]:
            total = cached + n
            table = torch.arange(-(-total // block_size), dtype=torch.long) % num_blocks
            batch = ForwardBatch(
                torch.zeros(n, dtype=torch.long),
                torch.arange(cached, total),
                torch.full((n,), -1, dtype=torch.long),
                (SeqSlice(0, n, total, table),),
                torch.tensor([n - 1]),
            ).to(dev)
            return lambda: model.forward(batch, cache, kv_scales=scales).cpu()

        timed = {f"{n}@{c}": _median_ms(forward(n, c), args.repeats, sync) for n, c in shapes}
        predicted = None
        if fit is not None:
            c0, c1, c2 = fit
            predicted = {
                f"{n}@{c}": round(1e3 * (c0 + c1 * n + c2 * PrefillModel.attention_work(n, c)), 3)
                for n, c in shapes
            }
    return {
        "device": args.device,
        "model": Path(args.model).name if args.model else "smollm2-135m",
        "repeats": args.repeats,
        "forward_ms": timed,
        "warm_up_fit": None if fit is None else [float(c) for c in fit],
        "predicted_ms": predicted,
        "attention_ms": attention_ms(args.device, args.repeats) if args.attention else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--model", default=None, help="model folder (default: the converted SmolLM2-135M)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="forwards per shape (median kept)")
    parser.add_argument(
        "--shapes", nargs="*", default=None, help="NEW@CACHED shapes instead of the default set"
    )
    parser.add_argument(
        "--attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time SDPA's bottom-right bias against the explicit mask",
    )
    args = parser.parse_args()
    emit(measure(args), args.json)


if __name__ == "__main__":
    main()
