"""The capacity curve's replays, shared between this process and forked helpers.

A report replays the trace once per policy and capacity of the curve; each replay is
single-threaded Python, so forked helpers run some of them on the other cores.
Helpers are forked as soon as the runner is built, before the caller starts any thread (the
progress bar's, a store's writers): fork copies only the calling thread, and the keyed trace
is inherited rather than pickled. Every process takes the next job not yet taken (a shared
counter), so a long job does not leave the others idle behind a fixed share, and each helper
sends results back on a pipe of its own: a helper that dies costs only a rerun of its missing
jobs here. Where fork
is unavailable, or with one worker, everything runs here.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from cachetier.report.replay import replay_belady
from cachetier.report.replay_cache import replay_hits
from cachetier.report.sampled import (
    SAMPLED_POLICIES,
    CurvePoint,
    SampledTrace,
    curve_point,
    exact_point,
)
from cachetier.util.checks import positive_int

Job = tuple[str, int]
"""One replay of the curve: an eviction policy name (or ``"belady"``) and a capacity in blocks."""


def run_job(sampled: SampledTrace, job: Job) -> CurvePoint:
    """Replay the sample of a trace as ``job`` says (its blocks weigh what they stand for, so
    the cache has the whole cache's capacity in bytes); a policy not in ``SAMPLED_POLICIES`` is
    replayed on the whole trace. Eviction policies run in a ``ReplayCache``, which holds what
    a ``CPUTier`` would.

    Args:
        sampled: the sampled trace (rate 1: the whole trace, exactly).
        job: policy (or ``"belady"``) and capacity of the whole trace's cache.

    Returns:
        The curve's point.
    """
    name, capacity = job
    positive_int("capacity_blocks", capacity)
    if name == "belady":
        result = replay_belady(sampled.trace, capacity)
        hits = [record.num_hit_blocks for record in result.records]
        return curve_point(sampled, name, capacity, hits, result.elapsed_s)
    if name not in SAMPLED_POLICIES:
        whole = sampled.whole
        hits, elapsed_s = replay_hits(whole.keys, whole.blocks, name, capacity)
        return exact_point(whole, name, capacity, hits, elapsed_s)
    hits, elapsed_s = replay_hits(sampled.trace.keys, sampled.trace.blocks, name, capacity)
    return curve_point(sampled, name, capacity, hits, elapsed_s)


Runner = Callable[[Any, Job], Any]
"""Runs one job: ``run_job``, or a caller's own that also knows other replays (the report's
admission replays)."""


class CurveRunner:
    """Runs a list of jobs here and in ``num_workers - 1`` forked helpers.

    Args:
        trace: what every job replays (a ``SampledTrace`` with ``run_job``), inherited by the
            helpers.
        jobs: the replays to run.
        num_workers: processes in all, this one included.
        run: what runs one job (default ``run_job``); its results must pickle.
    """

    def __init__(
        self, trace: Any, jobs: Sequence[Job], num_workers: int, run: Runner = run_job
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._trace = trace
        self._jobs = list(jobs)
        self._run = run
        num_workers = min(num_workers, len(self._jobs))
        if "fork" not in multiprocessing.get_all_start_methods():
            num_workers = 1
        self._local = [0]  # the next job, where no helper shares a counter
        self._helpers: list[tuple[BaseProcess, Connection]] = []
        ctx = multiprocessing.get_context("fork") if num_workers > 1 else None
        self._next: Any = ctx.Value("i", 0) if ctx is not None else None
        for _ in range(1, num_workers):
            assert ctx is not None, "helpers only where fork is available"
            reader, writer = ctx.Pipe(duplex=False)
            helper = ctx.Process(
                target=_helper,
                args=(trace, self._jobs, self._next, writer, run),
                name="cachetier-report-replay",
                daemon=True,
            )
            helper.start()
            writer.close()  # the helper's copy is the only writer: its death reads as EOF here
            self._helpers.append((helper, reader))

    @property
    def helper_pids(self) -> list[int]:
        """Process ids of the forked helpers (none when everything runs here)."""
        return [helper.pid for helper, _ in self._helpers if helper.pid is not None]

    def run(self, on_done: Callable[[Job], None] | None = None) -> list[Any]:
        """Run every job; returns when all are done.

        Args:
            on_done: called here with each job as its result arrives (a progress bar).

        Returns:
            The results, in job order (``CurvePoint``s with ``run_job``).
        """
        done = on_done or (lambda job: None)
        results: list[Any] = [None] * len(self._jobs)
        readers = [reader for _, reader in self._helpers]

        def collect(timeout: float | None) -> None:
            for reader in wait(readers, timeout):
                try:
                    index, result = reader.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    readers.remove(reader)  # finished, or died: its gaps are filled below
                    continue
                results[index] = result
                done(self._jobs[index])

        while (index := _take(self._next, len(self._jobs), self._local)) is not None:
            results[index] = self._run(self._trace, self._jobs[index])
            done(self._jobs[index])
            collect(0)
        while readers:
            collect(None)
        for index, result in enumerate(results):
            if result is None:
                results[index] = self._run(self._trace, self._jobs[index])
                done(self._jobs[index])
        for helper, reader in self._helpers:
            reader.close()
            helper.join(timeout=5)
        return [r for r in results if r is not None]


def _take(counter: Any, num_jobs: int, local: list[int]) -> int | None:
    """The next job nobody took yet (``local`` counts where there is no shared counter)."""
    if counter is None:
        index = local[0]
        local[0] += 1
    else:
        with counter.get_lock():
            index = counter.value
            counter.value = index + 1
    return index if index < num_jobs else None


def _helper(trace: Any, jobs: list[Job], counter: Any, writer: Connection, run: Runner) -> None:
    with writer:
        while (index := _take(counter, len(jobs), [0])) is not None:
            writer.send((index, run(trace, jobs[index])))
