"""Fresh Python interpreters for tests that need a second process (a restart, a race, a kill).

A support module (not a test module): test modules import it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def python_command(code: str, *args: str | Path) -> list[str]:
    """The command line that runs ``code`` (dedented) with ``args`` as ``sys.argv[1:]``."""
    return [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]


def child_env() -> dict[str, str]:
    """This environment, offline, with this checkout first on the path (never an installed
    copy of the packages)."""
    return {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO_ROOT)}


def run_python(code: str, *args: str | Path, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; return the last line it printed."""
    done = subprocess.run(
        python_command(code, *args),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def run_python_at_once(
    code: str, *args: str | Path, num_children: int = 2, timeout: float = 120
) -> list[str]:
    """Run ``code`` in ``num_children`` fresh interpreters at the same time (a race); return
    the last line each printed, once all have exited 0."""
    children = [
        subprocess.Popen(
            python_command(code, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for _ in range(num_children)
    ]
    outputs = [child.communicate(timeout=timeout) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
    return [out.strip().splitlines()[-1] for out, _ in outputs]
