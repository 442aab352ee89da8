"""Imports run one way (STYLE.md): a wrong arrow fails here, not in review."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)

# Modules of cachetier that serve HTTP (and the CLI that starts them); the core never imports them.
EDGE = {"cachetier.server", "cachetier.tiers.remote", "cachetier.cli"}
HTTP_LIBS = {"fastapi", "uvicorn", "aiohttp", "starlette", "prometheus_client"}


def _modules(package: str) -> list[tuple[str, Path]]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _is_edge(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in EDGE)


@pytest.mark.parametrize("module,path", _modules("kernels"))
def test_kernels_import_torch_and_triton_only(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) not in STDLIB | {"torch", "triton", "kernels"}]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("cachetier"))
def test_cachetier_imports_nothing_of_engine_connectors_or_kernels(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) in {"engine", "connectors", "kernels"}]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", [m for m in _modules("cachetier") if not _is_edge(m[0])])
def test_cachetier_core_does_not_import_the_http_edge(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) in HTTP_LIBS or _is_edge(n)]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("engine"))
def test_engine_does_not_import_connectors(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) == "connectors" or _top(n) == "vllm"]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module,path", [m for m in _modules("connectors") if not m[0].startswith("connectors.vllm")]
)
def test_only_the_vllm_plugin_imports_vllm(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) == "vllm"]
    assert not bad, f"{module} imports {bad}"


def test_one_hash_function() -> None:
    """Only cachetier.keys computes block hashes (a second routine would drift)."""
    offenders = []
    for package in ("cachetier", "engine", "connectors"):
        for module, path in _modules(package):
            if module == "cachetier.keys":
                continue
            text = path.read_text()
            if "sha256(" in text and "fingerprint" not in module:
                offenders.append(module)
    assert not offenders, f"hashing outside cachetier.keys: {offenders}"
