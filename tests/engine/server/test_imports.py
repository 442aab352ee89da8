"""The engine core never imports its HTTP edge (engine.server) or an HTTP library (STYLE.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_architecture import HTTP_LIBS, ROOT, _imports, _modules, _top

CORE = [(m, p) for m, p in _modules("engine") if not m.startswith("engine.server")]


@pytest.mark.parametrize("module,path", CORE)
def test_the_engine_core_does_not_import_the_server(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if n.startswith("engine.server") or _top(n) in HTTP_LIBS]
    assert not bad, f"{module} imports {bad}"


def test_there_is_a_core_to_check() -> None:
    assert ROOT.is_dir() and any(m == "engine.scheduler" for m, _ in CORE)
