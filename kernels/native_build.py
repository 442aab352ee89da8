"""Building the CPU kernels in ``kernels/csrc`` on first use, or falling back where we cannot.

Each extension is compiled with ``torch.utils.cpp_extension`` (g++ and ninja) the first time it
is asked for in a process; the build is cached under ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``), in a folder per Python and torch version and per digest of the
sources, the flags and the environment. It compiles a copy of ``csrc`` kept in that folder,
not the checkout's files: ninja rebuilds whenever a command changes, the source's path and
torch's include path among its words, so two checkouts or two environments on one node would
otherwise recompile over each other's build at every switch. A changed source or header gets
a folder of its own.

Several engine processes on one node load the same build. torch serialises them with a lock
file that only its holder removes, and every other loader polls for it forever, even for a
build that is already there: an engine killed while loading (an OOM kill, a pod deleted during
a first, minute-long compile) would leave every later engine on the node hanging at start. So
loads also take a ``flock`` of our own, which the kernel releases when its holder dies, and a
torch lock file found while holding it can only be such a leftover and is removed.
Where it cannot be built (no compiler, a read-only cache) the loader returns ``None`` once and
for all, with one warning, and callers take the torch path: the results are the same to float
rounding, only slower. ``CACHETIER_NATIVE_KERNELS=0`` keeps every call on the torch path (to
compare the two, or where compiling at run time is not wanted).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
DISABLE_ENV = "CACHETIER_NATIVE_KERNELS"
# -fopenmp: at::parallel_for is OpenMP in headers, so without it the tasks run on one thread.
# The extension then links libgomp.so.1 by soname, and the loader hands it the copy torch
# already loaded: one thread pool, torch's. -march=native: the build is cached per machine, and
# the inner loops want its widest vectors. -fno-trapping-math: GCC keeps a loop with floor()
# scalar (the exponentials of the softmax and of SiLU) while FP exceptions may trap; nothing
# here reads them, and results are bit-for-bit the same.
CFLAGS = ["-O3", "-fopenmp", "-march=native", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]


@functools.cache
def load_cpu_extension(name: str, source: str) -> ModuleType | None:
    """The extension built from ``csrc/<source>``, or ``None`` where it is off or cannot build.

    Args:
        name: the module's name (and its build folder's).
        source: a ``.cpp`` file in ``kernels/csrc``.

    Returns:
        The loaded module, or ``None`` when disabled by ``CACHETIER_NATIVE_KERNELS=0`` or when
        the build fails (logged once per extension).
    """
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        build = build_directory(name)
        with _only_loader(build):
            sources = _copy_sources(build)
            return load(
                name=name,
                sources=[str(sources / source)],
                build_directory=str(build),
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                verbose=False,
            )
    except Exception as exc:  # a missing compiler raises anything from OSError to RuntimeError
        log.warning("native CPU kernels %s unavailable, using the torch path: %s", name, exc)
        return None


def build_directory(name: str) -> Path:
    """Where extension ``name`` is built and cached: one folder per Python and torch version
    (a build for one is no use to the other) and per ``sources_digest``, under
    ``TORCH_EXTENSIONS_DIR`` if set."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return root / f"cachetier-{version}" / f"{name}-{sources_digest()}"


@functools.cache
def sources_digest() -> str:
    """A digest of every file in ``csrc`` (names and bytes), the flags and the Python
    environment: the key of a build, so that the same sources in one environment share one
    wherever they were checked out, and two environments never rebuild over each other."""
    # The environment too: torch's headers are included from its own path, which names it.
    digest = hashlib.sha256(repr((CFLAGS, LDFLAGS, sys.prefix)).encode())
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _copy_sources(build: Path) -> Path:
    """``csrc`` copied into ``build/src`` (once: the folder is keyed by their digest), which is
    what torch compiles, so that the build's commands name no checkout's path."""
    sources = build / "src"
    if not sources.is_dir():
        staging = build / "src.tmp"
        shutil.rmtree(staging, ignore_errors=True)  # a loader that died while copying
        shutil.copytree(CSRC, staging, ignore=shutil.ignore_patterns("__pycache__"))
        staging.rename(sources)
    return sources


@contextlib.contextmanager
def _only_loader(build: Path) -> Iterator[None]:
    """Hold this node's one loader slot for ``build`` (see the module docstring)."""
    build.mkdir(parents=True, exist_ok=True)
    with open(build.parent / f"{build.name}.flock", "a+b") as slot:
        fcntl.flock(slot, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            stale = build / "lock"  # torch's: every loader takes ours first, so a leftover
            if stale.exists():
                log.warning("removing %s, left by a loader that died", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(slot, fcntl.LOCK_UN)
