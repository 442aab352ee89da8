"""The engine keeps freed activations' memory: a later step's tensors do not fault in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES_PER_STEP = 25 * 8 * (1 << 20) // 4096

# Each run is a fresh process: how many pages an allocation faults in depends on the state of
# the whole heap, which other tests in the test process leave in any shape. (Run after them,
# one 16 MiB tensor freed and allocated again faulted 0 pages; run alone, 4,096, because
# posix_memalign's padding does not fit the chunk just freed. That earlier test was flaky.)
_CHILD = """
    import json, resource, sys
    import torch
    from cachetier.engine.host_memory import keep_freed_memory

    kept = [keep_freed_memory(), keep_freed_memory()] if sys.argv[1] == "keep" else []
    torch.set_num_threads(1)
    faults = []
    for step in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        # One step's activations: 25 tensors of 8 MiB live at once, then all freed.
        live = [torch.empty(2 << 20).fill_(1.0) for _ in range(25)]
        while live:
            live.pop()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": kept, "faults": faults}))
"""


def _steps(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), mode],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow(
    reason="runs two fresh processes that import torch and fault in memory step by step"
)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_later_steps_reuse_the_freed_activations_instead_of_faulting_pages_in() -> None:
    kept = _steps("keep")
    assert kept["kept"] == [True, True]  # set once per process; the answer is remembered
    first, second, _, *steady = kept["faults"]
    # The first step faults its memory in once (nearly all of it: pages the allocator kept
    # from the process's start are reused without a fault).
    assert first >= PAGES_PER_STEP * 3 // 4
    assert second < PAGES_PER_STEP // 2, kept  # the heap settles within a step or two
    # And then faults next to nothing in: now and then malloc places one of the step's 25
    # tensors anew (8 MiB, 1/25 of a step), never the step's memory as without the setting.
    assert sum(steady) <= PAGES_PER_STEP // 25, kept

    # The control, so this test fails if the setting does nothing: glibc's own thresholds give
    # the whole heap top back after the first step, and the second faults all of it in again.
    default = _steps("default")
    assert default["faults"][1] > PAGES_PER_STEP * 9 // 10, default
