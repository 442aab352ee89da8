"""Command line: ``python -m cachetier.engine generate`` runs prompts through the engine and tiers.

    python -m cachetier.engine generate --prompt "Why is the sky blue?" --chat --disk-path ./kv
    python -m cachetier.engine generate --prompt-file prompts.txt --max-tokens 64 --redis-url redis://...

Each line of a prompt file is one prompt. Prints each answer, its TTFT and how many prompt
tokens came from the cache, and from which tier.
"""

from __future__ import annotations

import argparse
import json
import sys

from cachetier.engine.config import KV_LOAD_POLICIES, MODEL_DTYPES
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.smollm2 import smollm2_path
from cachetier.store.config import StoreConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cachetier.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts")
    gen.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=MODEL_DTYPES)
    gen.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    gen.add_argument("--cpu-bytes", type=int, default=1 << 30, help="CPU tier capacity (0: none)")
    gen.add_argument("--disk-path", default=None, help="disk tier folder")
    gen.add_argument("--redis-url", default=None)
    gen.add_argument("--tenant", default="")
    gen.add_argument(
        "--kv-load-policy",
        default="cost",
        choices=KV_LOAD_POLICIES,
        help="cost: load a tier hit only where that beats recomputing it; always: load every hit",
    )
    gen.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N: where the weights, the KV pool and the forward live",
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per answer")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        prompts = args.prompt
    store = None
    if args.cpu_bytes or args.disk_path or args.redis_url:
        store = StoreConfig(
            cpu_bytes=args.cpu_bytes, disk_path=args.disk_path, redis_url=args.redis_url
        )
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    with LLM(
        args.model or smollm2_path(),
        store=store,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        tenant=args.tenant,
        kv_load_policy=args.kv_load_policy,
        device=args.device,
    ) as llm:
        ids = [llm.encode(p, chat=args.chat) for p in prompts]
        outputs = llm.generate(ids, params, use_tqdm=sys.stderr.isatty() or len(ids) > 1)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "ttft_s": out.ttft_s,
                        "num_cached_tokens": out.num_cached_tokens,
                        "cached_tokens_by_source": out.cached_tokens_by_source,
                    }
                )
            )
            continue
        sources = ", ".join(f"{k} {v}" for k, v in out.cached_tokens_by_source.items()) or "none"
        print(f"> {prompt}\n{out.text.strip()}")
        print(
            f"  [TTFT {out.ttft_s:.3f} s, {len(out.prompt_token_ids)} prompt tokens, "
            f"cached: {sources}, finish: {out.finish_reason}]\n"
        )


if __name__ == "__main__":
    main()
