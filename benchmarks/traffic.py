"""What cachetier buys on real traffic: a window of the Mooncake conversation trace replayed,
closed loop, through vLLM-CPU alone and with cachetier, through our engine, and through vLLM
with LMCache and with vLLM's native offloading, each a fresh server on the same pool.

The window, its scale and the order requests are sent in are ``benchmarks.support.traffic_trace``
and ``benchmarks.support.traffic_drive``; the servers ``benchmarks.support.traffic_servers``.
Every configuration gets the same requests in the same order, with ``--concurrency`` in flight,
a turn only after its conversation's previous answer. One untimed warm-up request (no block
shared with the window) comes first.

Per configuration: mean, p50 and p90 TTFT, requests per second, prompt tokens served from the
pool and from each tier, bytes written to the disk tier, and greedy outputs compared with the
baseline's (vLLM alone). The report's prediction: ``cachetier report`` replays the same window
as a scaled trace (``--block-size`` of one engine block), with the connector's CPU and disk
capacities in blocks, and its token hit rate is set beside the live one of
``vllm+cachetier``.

    python -m benchmarks.traffic --json [--num-requests N] [--configs vllm,vllm+cachetier]

The last line (``--json``) holds every figure; ``headline`` the issue's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.support import traffic_figures as figures
from benchmarks.support.children import REPO_ROOT
from benchmarks.support.fleet_live_procs import log_tail
from benchmarks.support.fleet_live_requests import WARMUP_ID_BASE
from benchmarks.support.output import emit
from benchmarks.support.traffic_drive import Answer, Endpoint, closed_loop, send
from benchmarks.support.traffic_servers import (
    CONFIGURATIONS,
    Shape,
    StartError,
    engine_config,
    folder_bytes,
    sidecar_config,
    vllm_config,
)
from benchmarks.support.traffic_trace import (
    TOKENS_PER_ID,
    TrafficRequest,
    ceiling_hit_rate,
    window,
    working_set_blocks,
    write_scaled_trace,
)
from cachetier.engine.smollm2 import smollm2_path
from cachetier.report.replay import read_trace

TRACE = REPO_ROOT / "workloads" / "mooncake_conversation_trace.jsonl.gz"
BASELINE, TARGET = "vllm", "vllm+cachetier"
# vLLM alone with one output token per request: the share of the baseline's wall that is
# prefill (and per-request overhead), the most a prefix cache could take off it.
PREFILL_ONLY = figures.PREFILL_ONLY
GiB = 1 << 30
CPU_TIER_BYTES, DISK_TIER_BYTES = 2 * GiB, 20 * GiB  # the connector's defaults
GUARD_FIRST_HITS = 1  # the connector's default (guard on)
RECORD_HEADER_BYTES = 256  # about what a record holds past its KV (checksums, side data)


def model_shape(model_dir: Path) -> dict[str, int]:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "num_layers": config["num_hidden_layers"],
        "num_kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim", config["hidden_size"] // heads),
    }


def warmup_request(vocab_size: int) -> TrafficRequest:
    from benchmarks.support.fleet_live_requests import id_tokens

    ids = tuple(range(WARMUP_ID_BASE, WARMUP_ID_BASE + 4))
    prompt = tuple(id_tokens(ids, vocab_size, TOKENS_PER_ID))
    return TrafficRequest(-1, -1, None, ids, prompt, 4)


async def drive(
    endpoint: Endpoint, requests: list[TrafficRequest], warmup: TrafficRequest, concurrency: int
) -> tuple[list[Answer], float]:
    async with endpoint.session() as session:
        first = await send(session, endpoint, warmup, 0.0)
    if first.error:
        raise StartError(f"the warm-up request failed: {first.error}")
    return await closed_loop(endpoint, requests, concurrency)


def metrics_text(endpoint: Endpoint) -> str:
    async def get() -> str:
        async with endpoint.session() as session:
            async with session.get(endpoint.base_url + "/metrics") as resp:
                return await resp.text()

    try:
        return asyncio.run(get())
    except Exception as exc:  # noqa: BLE001 - a missing figure, not a failed run
        return f"# /metrics failed: {exc}"


def run_config(
    name: str, work: Path, shape: Shape, requests: list[TrafficRequest], args: argparse.Namespace
) -> tuple[dict[str, Any], list[Answer]]:
    """Start ``name``'s server(s), drive the window through, stop them; its figures."""
    print(f"{name}: starting ...", file=sys.stderr, flush=True)
    warm = warmup_request(args.vocab_size)
    side = None
    if name == "engine+cachetier":
        server: Any = engine_config(work, shape)
    elif name == "vllm+cachetier-sidecar":
        side, server = sidecar_config(work, shape)
    else:
        server = vllm_config(name, work, shape)
    try:  # whatever started is stopped, whether or not the run got through
        if name == "engine+cachetier":
            server.spawn()
            server.wait()
            endpoint = Endpoint(server.url, model="smollm2")
        else:
            endpoint = server.start()
        print(f"{name}: driving {len(requests)} requests ...", file=sys.stderr, flush=True)
        if name == PREFILL_ONLY:
            requests = [dataclasses.replace(r, max_tokens=1) for r in requests]
        answers, wall_s = asyncio.run(drive(endpoint, requests, warm, args.concurrency))
        metrics = metrics_text(endpoint)
    finally:
        server.stop()
        if side is not None:
            side.stop()
    out = figures.answer_figures(answers, wall_s)
    log = log_tail(server.log_path, None)
    if name == "engine+cachetier":
        out["served_from"] = figures.engine_sources(answers)
        out["bytes_written"] = tier_bytes_in(metrics)
    else:
        out["served_from"] = figures.vllm_sources(metrics, log)
        out["cost_model_refusals_blocks"] = figures.cost_refusals(log)
        if name.startswith("vllm+cachetier"):
            out["bytes_written"] = {"cpu": figures.connector_saved_bytes(log)}
        out.update(figures.connector_writes(log))
    out["disk_bytes_written"] = folder_bytes(work / f"{name}-disk")
    print(f"{name}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out, answers


def tier_bytes_in(metrics: str) -> dict[str, float]:
    """Bytes each tier took in, from a ``/metrics`` page of ours (``cachetier_tier_bytes_in``)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("cachetier_tier_bytes_in_total{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


def report_prediction(
    requests: list[TrafficRequest], work: Path, block_bytes: int, pool_blocks: int, in_flight: int
) -> dict:
    """``cachetier report`` on the window as a scaled trace, with the engines' pool and the
    connector's tier sizes, the client's requests in flight, and the restore guard as it runs
    at defaults (its first hit per tier computed)."""
    trace = work / "window.jsonl"
    write_scaled_trace(requests, trace)
    record = block_bytes + RECORD_HEADER_BYTES
    cpu_blocks, disk_blocks = CPU_TIER_BYTES // record, DISK_TIER_BYTES // record
    out_json = work / "report.json"
    argv = [sys.executable, "-m", "cachetier.cli.main", "report", "--trace", str(trace)]
    argv += ["--block-size", str(TOKENS_PER_ID), "--cpu-blocks", str(cpu_blocks)]
    argv += ["--disk-blocks", str(disk_blocks), "--capacities", str(cpu_blocks)]
    argv += ["--pool-blocks", str(pool_blocks), "--guard-first-hits", str(GUARD_FIRST_HITS)]
    argv += ["--in-flight", str(in_flight)]
    argv += ["--admission-policies", "none", "--curve-policies", "lru", "--jobs", "1"]
    argv += ["--quiet", "--out", str(work / "report.html"), "--json-out", str(out_json)]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    head = json.loads(out_json.read_text())["headline"]
    return {
        "cpu_blocks": cpu_blocks,
        "disk_blocks": disk_blocks,
        "hit_rate": round(head["token_hit_ratio"], 4),
        "hit_tokens_by_source": head["hit_tokens_by_source"],
        "verified_by_guard_tokens": head["verified_by_guard_tokens"],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--sample-every",
        type=int,
        default=20,
        help="one conversation in this many, over the whole trace (default 20)",
    )
    p.add_argument("--num-requests", type=int, help="only the sample's first N requests")
    p.add_argument("--max-ids", type=int, default=48, help="longest request kept, in hash ids")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument(
        "--pool-blocks",
        type=int,
        default=224,
        help="every engine's KV pool: the running requests' blocks and a few more (default 224)",
    )
    p.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="server threads")
    p.add_argument("--work-dir", help="keep the servers' folders and logs here")
    return p.parse_args()


def setup(args: argparse.Namespace) -> tuple[list[TrafficRequest], Shape, dict[str, Any]]:
    """The sample, the shape every server gets, and the result's description of both."""
    model_dir = smollm2_path()
    dims = model_shape(model_dir)
    args.vocab_size = dims["vocab_size"]
    requests = window(
        read_trace(TRACE),
        args.num_requests,
        vocab_size=args.vocab_size,
        max_ids=args.max_ids,
        sample_every=args.sample_every,
    )
    per_token = 2 * 4 * dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"]  # K, V fp32
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    shape = Shape(
        model_dir=model_dir,
        block_size=TOKENS_PER_ID,
        pool_blocks=args.pool_blocks,
        block_bytes=per_token * TOKENS_PER_ID,
        max_model_len=-(-longest // TOKENS_PER_ID) * TOKENS_PER_ID,
        num_threads=args.threads,
    )
    described = {
        "trace": TRACE.name,
        "sample_every_conversations": args.sample_every,
        "window_requests": len(requests),
        "max_ids": args.max_ids,
        "tokens_per_id": TOKENS_PER_ID,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "working_set_blocks": working_set_blocks(requests),
        "pool_blocks": args.pool_blocks,
        "ceiling_hit_rate": round(ceiling_hit_rate(requests, TOKENS_PER_ID), 4),
        "concurrency": args.concurrency,
        "threads": args.threads,
        "model": "SmolLM2-135M-Instruct, float32",
    }
    return requests, shape, described


def run_all(
    names: list[str], work: Path, shape: Shape, requests: list[TrafficRequest], args: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, list[Answer]]]:
    """Every configuration in turn; a configuration that does not start is reported so."""
    configs: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[Answer]] = {}
    for name in names:
        try:
            configs[name], answers[name] = run_config(name, work, shape, requests, args)
        except (StartError, RuntimeError) as exc:
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
            # The why, in a line (the log's tail went to stderr above).
            configs[name] = {"error": str(exc).splitlines()[0][:500]}
    if BASELINE in answers:
        for name, got in answers.items():
            if name == PREFILL_ONLY:  # one token each: nothing to compare
                continue
            configs[name].update(figures.outputs_against(got, answers[BASELINE]))
    if args.work_dir:
        for name, got in answers.items():
            with (work / f"answers-{name}.jsonl").open("w") as out:
                for a in got:
                    out.write(json.dumps(dataclasses.asdict(a)) + "\n")
    return configs, answers


def compare_with_report(
    requests: list[TrafficRequest],
    work: Path,
    shape: Shape,
    live: list[Answer] | None,
    in_flight: int,
) -> dict[str, Any]:
    """The report's prediction (``in_flight``: the client's requests in flight), and where the
    live run of ``TARGET`` differs from it."""
    report = report_prediction(requests, work, shape.block_bytes, shape.pool_blocks, in_flight)
    if live is not None and "cpu_blocks" in report:
        blocks = (shape.pool_blocks, report["cpu_blocks"], report["disk_blocks"])
        predicted = figures.predicted_hits(
            requests, TOKENS_PER_ID, blocks, GUARD_FIRST_HITS, in_flight
        )
        report["live_vs_report"] = figures.hit_gap(live, predicted)
    return report


def main() -> None:
    args = parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONFIGURATIONS))
    if unknown:
        sys.exit(f"unknown configurations {unknown}; known: {', '.join(CONFIGURATIONS)}")
    requests, shape, result = setup(args)
    with tempfile.TemporaryDirectory(prefix="bench-traffic-") as tmp:
        # --work-dir keeps the servers' folders, logs and answers for a look after the run.
        work = Path(tempfile.mkdtemp(prefix="traffic-", dir=args.work_dir or tmp))
        result["configs"], answers = run_all(names, work, shape, requests, args)
        result["report"] = compare_with_report(
            requests, work, shape, answers.get(TARGET), args.concurrency
        )
    result["headline"] = head = figures.headline(
        result["configs"], BASELINE, TARGET, result["ceiling_hit_rate"]
    )
    live = (result["configs"].get(TARGET) or {}).get("hit_rate")
    predicted = result["report"].get("hit_rate")
    if live is not None and predicted is not None:
        head["hit_rate_live"] = live
        head["hit_rate_report"] = predicted
        head["hit_rate_live_vs_report_abs_diff"] = round(abs(live - predicted), 4)
    emit(result, args.json)


if __name__ == "__main__":
    main()
