"""Building the CPU kernels in ``kernels/csrc`` on first use, or falling back where we cannot.

Each extension is compiled with ``torch.utils.cpp_extension`` (g++ and ninja) the first time it
is asked for in a process; torch caches the build under ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``) and rebuilds it when its source or a header it includes changes.
Where it cannot be built (no compiler, a read-only cache) the loader returns ``None`` once and
for all, with one warning, and callers take the torch path: the results are the same to float
rounding, only slower. ``CACHETIER_NATIVE_KERNELS=0`` keeps every call on the torch path (to
compare the two, or where compiling at run time is not wanted).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
DISABLE_ENV = "CACHETIER_NATIVE_KERNELS"


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

        return load(
            name=name,
            sources=[str(CSRC / source)],
            # -fopenmp: at::parallel_for is OpenMP in headers, so without it the tasks run on
            # one thread. The extension then links libgomp.so.1 by soname, and the loader hands
            # it the copy torch already loaded: one thread pool, torch's. -march=native: the
            # build is cached per machine, and the inner loops want its widest vectors.
            # -fno-trapping-math: GCC keeps a loop with floor() scalar (the exponentials of the
            # softmax and of SiLU) while FP exceptions may trap; nothing here reads them, and
            # results are bit-for-bit the same.
            extra_cflags=["-O3", "-fopenmp", "-march=native", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler raises anything from OSError to RuntimeError
        log.warning("native CPU kernels %s unavailable, using the torch path: %s", name, exc)
        return None
