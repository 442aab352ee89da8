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
