"""cachetier behind the plugin points of SGLang and LMCache, each against that engine's own
store on the same data in the same run.

- SGLang (this venv, ``benchmarks.plugins.sglang``): our HiCache backend and SGLang's
  ``HiCacheFile``, both made by SGLang's ``StorageBackendFactory``: pages round-trip, pages
  found after a restart, and batch get speed.
- LMCache 0.5.6 (``.venv-peers``, ``benchmarks.plugins.lmcache``, run as a child process):
  our storage plugin and LMCache's ``LocalDiskBackend`` through LMCache's ``StorageManager``:
  chunks found after a restart, and batch get speed.

Ratios are theirs over ours in time (> 1: we are faster), medians of alternating runs.

    make bench-plugins        # sets up .venv and .venv-peers, then runs:
    .venv/bin/python -m benchmarks.plugins --json
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.support.children import REPO_ROOT, module_command, run_json
from benchmarks.support.output import emit

PEERS_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"


def lmcache_figures(work: Path, chunks: int) -> dict[str, Any]:
    """The LMCache figures, measured by a child process in ``.venv-peers``."""
    if not PEERS_PYTHON.exists():
        raise SystemExit(f"{PEERS_PYTHON} is missing: run `make setup-peers` first")
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO_ROOT)}
    argv = module_command(
        "benchmarks.plugins.lmcache",
        "--work",
        str(work),
        "--chunks",
        str(chunks),
        python=PEERS_PYTHON,
    )
    return run_json(argv, timeout=1800, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON last")
    parser.add_argument("--pages", type=int, default=64, help="SGLang pages (1.4 MiB each)")
    parser.add_argument("--chunks", type=int, default=32, help="LMCache chunks")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-lmcache", action="store_true")
    args = parser.parse_args()
    from benchmarks.plugins import sglang

    with tempfile.TemporaryDirectory(prefix="bench-plugins-") as tmp:
        result = sglang.measure(Path(tmp), args.pages, args.repeats)
        if not args.skip_lmcache:
            result.update(lmcache_figures(Path(tmp), args.chunks))
    emit(result, args.json)


if __name__ == "__main__":
    main()
