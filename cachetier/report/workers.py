"""The capacity curve's replays, shared between this process and forked helpers.

A report replays the trace once per policy and capacity of the curve; each replay is
single-threaded Python, so forked helpers run some of them on the other cores.
Helpers are forked as soon as the runner is built, before the caller starts any thread (the
progress bar's, a store's writers): fork copies only the calling thread, and the keyed trace
is inherited rather than pickled. Each helper takes every n-th job and sends results back on a
pipe of its own, so a helper that dies costs only a rerun of its missing jobs here. Where fork
is unavailable, or with one worker, everything runs here.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from cachetier.report.replay import ReplayResult, ReplayTrace, replay_belady, replay_tier

Job = tuple[str, int]
"""One replay of the curve: an eviction policy name (or ``"belady"``) and a capacity in blocks."""


def run_job(trace: ReplayTrace, job: Job) -> ReplayResult:
    """Replay ``trace`` as ``job`` says.

    Args:
        trace: the keyed trace.
        job: policy (or ``"belady"``) and capacity.

    Returns:
        The replay's result.
    """
    name, capacity = job
    if name == "belady":
        return replay_belady(trace, capacity)
    return replay_tier(trace, name, capacity)


Runner = Callable[[ReplayTrace, Job], Any]
"""Runs one job: ``run_job``, or a caller's own that also knows other replays (the report's
admission replays)."""


class CurveRunner:
    """Runs a list of jobs here and in ``num_workers - 1`` forked helpers.

    Args:
        trace: the keyed trace.
        jobs: the replays to run.
        num_workers: processes in all, this one included.
        run: what runs one job (default ``run_job``); its results must pickle.
    """

    def __init__(
        self, trace: ReplayTrace, jobs: Sequence[Job], num_workers: int, run: Runner = run_job
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._trace = trace
        self._jobs = list(jobs)
        self._run = run
        num_workers = min(num_workers, len(self._jobs))
        if "fork" not in multiprocessing.get_all_start_methods():
            num_workers = 1
        self._stride = num_workers
        self._helpers: list[tuple[BaseProcess, Connection]] = []
        ctx = multiprocessing.get_context("fork") if num_workers > 1 else None
        for offset in range(1, num_workers):
            assert ctx is not None, "helpers only where fork is available"
            reader, writer = ctx.Pipe(duplex=False)
            helper = ctx.Process(
                target=_helper,
                args=(trace, self._jobs, offset, num_workers, writer, run),
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
            The results, in job order (``ReplayResult``s with ``run_job``).
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

        for index in range(0, len(self._jobs), self._stride):
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


def _helper(
    trace: ReplayTrace, jobs: list[Job], offset: int, stride: int, writer: Connection, run: Runner
) -> None:
    with writer:
        for index in range(offset, len(jobs), stride):
            writer.send((index, run(trace, jobs[index])))
