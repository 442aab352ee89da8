"""Imports run one way (STYLE.md): a wrong arrow fails here, not in review."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)

# Modules of cachetier that serve HTTP (and the CLI that starts them); the core never imports them.
# ``cachetier.protocol``, what the server and the remote tier both speak, is core, not edge.
EDGE = {"cachetier.server", "cachetier.tiers.remote", "cachetier.cli"}
HTTP_LIBS = {"fastapi", "uvicorn", "aiohttp", "starlette", "prometheus_client"}
# The one place that turns a StoreConfig into tiers may name the remote tier, inside a function
# only: importing the core still never imports the edge
# (test_the_core_imports_without_http_libraries).
LAZY_EDGE_IMPORTS = {"cachetier.config": {"cachetier.tiers.remote"}}


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


def _module_level_imports(path: Path) -> set[str]:
    """Imports outside any function (run when the module is imported)."""
    names: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_edge(module: str) -> bool:
    return any(_is_under(module, e) for e in EDGE)


@pytest.mark.parametrize("module,path", _modules("kernels"))
def test_kernels_import_torch_and_triton_only(module: str, path: Path) -> None:
    # numpy too: the CPU path of the layout copies runs through it (a strided numpy copy
    # starts ten times faster than a torch op), and the core depends on it already.
    allowed = STDLIB | {"torch", "triton", "numpy", "kernels"}
    bad = [n for n in _imports(path) if _top(n) not in allowed]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("cachetier"))
def test_cachetier_imports_nothing_of_engine_connectors_or_kernels(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) in {"engine", "connectors", "kernels"}]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", [m for m in _modules("cachetier") if not _is_edge(m[0])])
def test_cachetier_core_does_not_import_the_http_edge(module: str, path: Path) -> None:
    lazy_ok = LAZY_EDGE_IMPORTS.get(module, set()) - _module_level_imports(path)
    bad = [n for n in _imports(path) if (_top(n) in HTTP_LIBS or _is_edge(n)) and n not in lazy_ok]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("cachetier/tiers"))
def test_no_tier_imports_the_server(module: str, path: Path) -> None:
    """The remote tier is the sidecar's client: what both ends share is in
    ``cachetier.protocol``, so a change to the server never reaches into a tier."""
    bad = [n for n in _imports(path) if _is_under(n, "cachetier.server")]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("cachetier/server"))
def test_the_server_does_not_import_its_client(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _is_under(n, "cachetier.tiers.remote")]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("cachetier/protocol"))
def test_the_protocol_imports_neither_end(module: str, path: Path) -> None:
    """The wire formats sit below both their users: not the server, not a tier, and no HTTP
    library (the protocol is not the HTTP edge; the core rules above also hold for it)."""
    ends = ("cachetier.server", "cachetier.tiers")
    bad = [n for n in _imports(path) if _top(n) in HTTP_LIBS or any(_is_under(n, e) for e in ends)]
    assert not bad, f"{module} imports {bad}"


def test_the_core_imports_without_http_libraries() -> None:
    """Every core module imports in a process where the HTTP libraries cannot be imported."""
    core = [m for m, _ in _modules("cachetier") if not _is_edge(m)]
    blocked = "; ".join(f"sys.modules[{lib!r}] = None" for lib in sorted(HTTP_LIBS))
    code = f"import importlib, sys; {blocked}; [importlib.import_module(m) for m in {core!r}]"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("module,path", _modules("engine"))
def test_engine_does_not_import_connectors(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) == "connectors" or _top(n) == "vllm"]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module,path", [m for m in _modules("engine") if not m[0].startswith("engine.server")]
)
def test_the_engine_core_does_not_import_its_server(module: str, path: Path) -> None:
    """``engine.server`` is the engine's HTTP edge, as ``cachetier.server`` is the core's."""
    bad = [n for n in _imports(path) if n.startswith("engine.server") or _top(n) in HTTP_LIBS]
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module,path", _modules("connectors"))
def test_connectors_import_nothing_of_our_engine(module: str, path: Path) -> None:
    """Connectors plug cachetier into other engines (vLLM, transformers). What they share with
    our engine, the block key, the model fingerprint and the dtype names, is cachetier's, so
    none of them needs ``engine``: importing it would load our model code and kernels (Triton)
    into vLLM's processes for nothing. Our own engine reaches the tiers through its
    ``engine.tier_bridge``, not through a connector, so not even ``engine.llm`` is allowed."""
    bad = [n for n in _imports(path) if _top(n) == "engine"]
    assert not bad, f"{module} imports {bad}"


def test_cachetier_imports_without_torch() -> None:
    """Every cachetier module, the sidecar included, imports where torch cannot: an operator
    installs ``cachetier[server]`` without it (``keys.torch_dtype`` imports it when called)."""
    modules = [m for m, _ in _modules("cachetier")]
    code = (
        "import importlib, sys; sys.modules['torch'] = None; "
        f"[importlib.import_module(m) for m in {modules!r}]"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(
    "module,path", [m for m in _modules("connectors") if not m[0].startswith("connectors.vllm")]
)
def test_only_the_vllm_plugin_imports_vllm(module: str, path: Path) -> None:
    bad = [n for n in _imports(path) if _top(n) == "vllm"]
    assert not bad, f"{module} imports {bad}"


def test_one_hash_function() -> None:
    """Only cachetier.keys computes block hashes (a second routine would drift)."""
    # The report page's Content-Security-Policy names its one script by a SHA-256 digest, which
    # CSP defines: a digest of page text, no block hash.
    not_block_hashes = {"cachetier.keys", "cachetier.report.page_script"}
    offenders = []
    for package in ("cachetier", "engine", "connectors"):
        for module, path in _modules(package):
            if module in not_block_hashes:
                continue
            text = path.read_text()
            if "sha256(" in text and "fingerprint" not in module:
                offenders.append(module)
    assert not offenders, f"hashing outside cachetier.keys: {offenders}"


def test_nothing_reads_a_path_only_our_machines_have() -> None:
    """A user's clone has none of our team folder beside it, nor our machines' paths: the
    product, its tests, benchmarks and build files ship what they read (issue 13)."""
    # Spelt in pieces so that this file does not match itself.
    forbidden = ("../" + "shared", "/" + "work/", "shared" + "/workloads", "shared" + "/schemas")
    tracked = subprocess.run(
        [
            "git",
            "ls-files",
            "cachetier",
            "engine",
            "kernels",
            "connectors",
            "tests",
            "benchmarks",
            "scripts",
            "deploy",
            "Makefile",
            ".ci",
            "Dockerfile",
            "docker-compose.yml",
            "pyproject.toml",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not tracked:  # a copy without git: read the folders themselves
        tracked = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")]
    offenders = []
    for rel in tracked:
        path = ROOT / rel
        if not path.is_file() or path.suffix in {".gz", ".png"}:
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{rel}: {word}" for word in forbidden if word in text]
    assert not offenders, offenders


@pytest.mark.parametrize("module,path", _modules("tests"))
def test_no_test_module_imports_another(module: str, path: Path) -> None:
    """What tests share lives in conftest.py fixtures and support modules (``tests/support.py``,
    ``tests/server/live.py``...), never in a ``test_*`` module another one imports."""
    names = _imports(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names]  # from pkg import mod
    tests = [n for n in names if n.startswith("tests.") and n.split(".")[-1].startswith("test_")]
    bad = [n for n in tests if (ROOT / (n.replace(".", "/") + ".py")).is_file()]
    assert not bad, f"{module} imports {bad}"
