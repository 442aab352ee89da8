"""Fresh Python interpreters for tests that need a second process (a restart, a race, a kill).

A support module (not a test module): test modules import it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
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


def run_spec_module(
    module: str, spec: dict[str, Any], workdir: Path, name: str, *, timeout: float = 900
) -> tuple[Any, str]:
    """Run ``python -m module SPEC OUT`` in vLLM-CPU's child environment, with ``spec`` as JSON.

    Its output (stdout and stderr) goes to ``<workdir>/<name>.log``; it must exit 0.

    Returns:
        What it wrote to ``OUT`` (JSON), and its log.
    """
    from cachetier.connectors.vllm.launch import vllm_cpu_env

    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", module, str(spec_path), str(out_path)],
            cwd=REPO_ROOT,
            env=vllm_cpu_env(os.environ, pythonpath=str(REPO_ROOT)),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{text[-6000:]}"
    return json.loads(out_path.read_text()), text


def spec_main(run: Callable[[dict[str, Any]], Any], description: str | None = None) -> None:
    """The child's side of ``run_spec_module``: ``python -m module SPEC OUT`` reads the spec
    (JSON), calls ``run`` with it and writes what it returns to ``OUT`` (JSON)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("spec", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    args.out.write_text(json.dumps(run(json.loads(args.spec.read_text()))))


def run_peers(script: Path | str, *args: str | Path) -> dict[str, Any]:
    """Run ``script`` with ``.venv-peers``' Python (LMCache's env); its last line, parsed.
    A ``str`` is a module's dotted name (``benchmarks.put_cpu``), run with ``-m``."""
    if not PEERS_PYTHON.exists():
        pytest.fail(f"{PEERS_PYTHON} is missing: run `make setup-peers` (make test does)")
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO_ROOT)}
    target = [str(script)] if isinstance(script, Path) else ["-m", script]
    done = subprocess.run(
        [str(PEERS_PYTHON), *target, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
