"""What every benchmark shares: interleaved timing, medians, and the JSON last line."""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def interleaved_medians(
    runs: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of each function, run in turn (a, b, a, b, ...) so drift hits all alike.

    Args:
        runs: name -> function to time (one call is one sample).
        repeats: samples per function.
        warmup: untimed calls of each function first.

    Returns:
        name -> median seconds.
    """
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_ratio_interval(
    num: Sequence[float], den: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """The median of the per-round ratios ``num[i] / den[i]`` of two interleaved runs, and a
    distribution-free interval for it (order statistics of the binomial, nothing assumed of
    the ratios' shape). Samples taken in turn are paired: the drift a round sees hits both,
    so a ratio's spread across rounds says whether a median ratio near 1.0 is a difference
    or this machine's noise.

    Args:
        num: one op's samples, in round order (e.g. the peer's seconds).
        den: the other op's, the same rounds.
        confidence: the interval's coverage of the true median ratio, at least.

    Returns:
        ``(low, median, high)``; with too few rounds for that coverage, the lowest and
        highest ratio seen.

    Raises:
        ValueError: no rounds, rounds that do not pair up, or a sample that is not > 0.
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"{len(num)} and {len(den)} samples do not pair up round by round")
    if min(den) <= 0 or min(num) <= 0:
        raise ValueError("a sample is not a positive time")
    ratios = sorted(a / b for a, b in zip(num, den, strict=True))
    n = len(ratios)
    # The k-th lowest and k-th highest ratios bound the median with probability
    # 1 - 2 * P(Binomial(n, 1/2) < k): the largest k that keeps that at least ``confidence``.

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = max((k for k in range(1, n // 2 + 1) if coverage(k) >= confidence), default=1)
    return ratios[k - 1], statistics.median(ratios), ratios[n - k]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far, in nanoseconds (Linux).

    ``/proc/<pid>/task/<tid>/schedstat`` counts each thread's time on a CPU in nanoseconds;
    ``/proc/<pid>/stat`` and ``getrusage`` of another process count 10 ms ticks, too coarse
    for one put. A thread that ends between the listing and its read is left out.
    """
    total = 0
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def settle() -> None:
    """Free what earlier measurements left behind and hand it back to the OS, so the heap
    state one measurement leaves does not tilt the next (glibc only; a no-op elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a human summary, then (with ``--json``) the result as the last line."""
    for key, value in result.items():
        if isinstance(value, float):
            print(f"{key:>32}: {value:.4g}", file=sys.stderr if as_json else sys.stdout)
        elif not isinstance(value, dict):
            print(f"{key:>32}: {value}", file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result, sort_keys=True))


def run_json(
    argv: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run a benchmark step as its own process; the JSON of its last line.

    Args:
        argv: the command (interpreter, script, arguments).
        timeout: seconds it may take.
        env: its environment (``None``: this one's).

    Raises:
        RuntimeError: it failed (with the end of its stderr).
    """
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:2])} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_vllm_child(
    script: Path,
    spec: dict[str, Any],
    workdir: Path,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
) -> tuple[dict[str, Any], str]:
    """Run ``script --child SPEC OUT`` as a fresh vLLM-CPU process (``vllm_cpu_env``).

    Args:
        script: the benchmark, whose ``--child`` mode reads the spec and writes its result.
        spec: what the child runs (JSON).
        workdir: where ``name.spec``, ``name.out`` and ``name.log`` go.
        name: the run's name.
        env: variables set over ``vllm_cpu_env``'s.
        timeout: seconds the child may take.

    Returns:
        The child's result and its log. A child that fails ends the benchmark with its log.
    """
    from cachetier.connectors.vllm.launch import vllm_cpu_env

    root = Path(__file__).resolve().parents[1]
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec", "out", "log"))
    spec_path.write_text(json.dumps(spec))
    child_env = vllm_cpu_env(os.environ, pythonpath=str(root))
    child_env.update(env or {})
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(script), "--child", str(spec_path), str(out_path)],
            cwd=root,
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"{name} process failed ({proc.returncode}):\n{text[-4000:]}")
    return json.loads(out_path.read_text()), text


def free_port() -> int:
    """A TCP port nobody listens on right now, closed again: racy (any program may take it
    before the benchmark's server binds it), so benchmarks only; tests start their servers on
    port 0 (``tests/server/test_ports_file.py`` checks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
