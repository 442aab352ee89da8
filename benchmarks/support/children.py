"""The processes a benchmark starts: a step of its own or of another benchmark (``python -m``),
a vLLM-CPU child, and the port of a server it starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The checkout: benchmarks run from here (``python -m benchmarks.<name>``), their children too.
REPO_ROOT = Path(__file__).resolve().parents[2]


def module_command(module: str, *args: str, python: str | Path = sys.executable) -> list[str]:
    """``python -m module args``: how a benchmark runs a step in a fresh process.

    Args:
        module: the benchmark's module, e.g. ``benchmarks.tiers``.
        args: its arguments.
        python: the interpreter (another virtual environment's, say).

    Returns:
        The command line; run it from ``REPO_ROOT``, where ``benchmarks`` imports.
    """
    return [str(python), "-m", module, *args]


def run_json(
    argv: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run a benchmark step as its own process, from ``REPO_ROOT``; the JSON of its last line.

    Args:
        argv: the command (``module_command``'s, say).
        timeout: seconds it may take.
        env: its environment (``None``: this one's).

    Raises:
        RuntimeError: it failed (with the end of its stderr).
    """
    done = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:3])} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_vllm_child(
    module: str,
    spec: dict[str, Any],
    workdir: Path,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
) -> tuple[dict[str, Any], str]:
    """Run ``python -m module --child SPEC OUT`` as a fresh vLLM-CPU process (``vllm_cpu_env``).

    Args:
        module: the benchmark module whose ``--child`` mode reads the spec and writes its result.
        spec: what the child runs (JSON).
        workdir: where ``name.spec``, ``name.out`` and ``name.log`` go.
        name: the run's name.
        env: variables set over ``vllm_cpu_env``'s.
        timeout: seconds the child may take.

    Returns:
        The child's result and its log. A child that fails ends the benchmark with its log.
    """
    from cachetier.connectors.vllm.launch import vllm_cpu_env

    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec", "out", "log"))
    spec_path.write_text(json.dumps(spec))
    child_env = vllm_cpu_env(os.environ, pythonpath=str(REPO_ROOT))
    child_env.update(env or {})
    with open(log_path, "w") as log:
        proc = subprocess.run(
            module_command(module, "--child", str(spec_path), str(out_path)),
            cwd=REPO_ROOT,
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
