"""cachetier.kernels.native_build: engines on one node share each build; one that dies while loading
it must not leave the others hanging.

The loads are real (the build is torch's, cached after its first compile): a holder process
takes the loader slot and leaves torch's lock file, as a loader killed mid-build does.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.children import child_env, python_command, run_python

pytestmark = pytest.mark.slow(
    reason="builds torch's fused-ops extension and loads it in fresh processes"
)

# Holds the slot of the fused-ops build with torch's lock file in place, as a loader in the
# middle of a build does, until it is killed.
_HOLDER = """
    import sys, time
    from cachetier.kernels.native_build import _only_loader, build_directory
    build = build_directory("cachetier_fused_ops_cpu")
    with _only_loader(build):
        (build / "lock").touch()
        print("holding", flush=True)
        time.sleep(3600)
"""
_LOADER = """
    from cachetier.kernels.fused_ops import native_fused_ops
    print("loaded" if native_fused_ops() is not None else "unavailable")
"""


def _holder() -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        python_command(_HOLDER), stdout=subprocess.PIPE, text=True, env=child_env()
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def test_a_loader_killed_mid_build_does_not_hang_the_next() -> None:
    assert run_python(_LOADER, timeout=900) == "loaded"  # built (or found built) first
    holder = _holder()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # torch's own lock file is still there; before the loader slot, this load waited forever.
    assert run_python(_LOADER, timeout=300) == "loaded"


def test_a_live_loader_is_waited_for_not_overridden() -> None:
    assert run_python(_LOADER, timeout=900) == "loaded"
    holder = _holder()
    waiting = subprocess.Popen(
        python_command(_LOADER), stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=5)  # still waiting for the holder: its lock was left alone
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    out, _ = waiting.communicate(timeout=300)
    assert out.strip() == "loaded"
