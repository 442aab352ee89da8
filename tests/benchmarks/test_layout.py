"""The benchmarks' layout: modules run with ``python -m``, imports that run one way, and no file
of the checkout naming a benchmark that is not there."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# A path or a dotted name under benchmarks/, as a doc, a comment or a command spells it.
_PATH = re.compile(r"(?<![\w./-])benchmarks/[\w/]*\.py\b")
_DOTTED = re.compile(r"(?<![\w./-])benchmarks(?:\.\w+)+")
_FILE_SUFFIXES = {"md", "json", "py", "txt", "html", "csv", "png", "svg"}  # docs/benchmarks.md


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(BENCHMARKS.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The benchmarks module ``name`` stands for: itself, or the module of which it is an
    attribute (``from benchmarks.peers import restart`` -> ``benchmarks.peers.restart``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path) -> set[str]:
    """The benchmarks modules ``module`` imports, anywhere in it (inside functions too), and
    the packages above each (importing a module runs its packages' ``__init__``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*above, *([base] if base else [])])
            names += [f"{base}.{alias.name}" for alias in node.names]
    out: set[str] = set()
    for name in names:
        found = _resolve(name) if name.split(".")[0] == "benchmarks" else None
        while found:
            out.add(found)
            found = found.rpartition(".")[0]
    out.discard(module)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated last), if any."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_benchmarks_import_one_another_without_a_cycle() -> None:
    graph = {module: _imported(module, path) for module, path in MODULES.items()}
    assert graph["benchmarks.engine"] >= {"benchmarks.support.vllm_batch"}  # the graph sees
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path``: assign to it or an item of it, or call its methods."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value]
        for target in targets:
            if is_sys_path(target) or (
                isinstance(target, ast.Subscript) and is_sys_path(target.value)
            ):
                lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_benchmark_edits_sys_path(module: str) -> None:
    """Every benchmark runs as ``python -m benchmarks.<name>`` from the checkout's root, where
    ``benchmarks`` and ``tests`` import as they are: nothing needs the path bent."""
    path = MODULES[module]
    assert not _edits_sys_path(ast.parse(path.read_text(), str(path))), module


def test_the_sys_path_check_sees_every_edit() -> None:
    code = "sys.path.insert(0, 'x')\nsys.path.append('x')\nsys.path = []\nsys.path[0] = 'x'\n"
    assert _edits_sys_path(ast.parse(code)) == [1, 2, 3, 4]
    assert _edits_sys_path(ast.parse("print(sys.path)\nos.path.join('a')\n")) == []


def _runs_as_main(path: Path) -> bool:
    return path.name == "__main__.py" or '__name__ == "__main__"' in path.read_text()


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if _runs_as_main(p)))
def test_every_runnable_module_shows_its_python_m_command(module: str) -> None:
    command = module.removesuffix(".__main__")  # a package runs its __main__
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text())) or ""
    assert re.search(rf"-m {re.escape(command)}(?![\w.])", doc), f"{module}: no `-m {command}`"


def _defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` binds ``name`` at its top level."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = {node.name}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            continue
        if name in bound:
            return True
    return False


def _stale(text: str) -> list[str]:
    """The benchmark paths and dotted names in ``text`` that name nothing there now."""
    stale = [p for p in _PATH.findall(text) if not (ROOT / p).is_file()]
    for name in _DOTTED.findall(text):
        if name.count(".") == 1 and name.partition(".")[2] in _FILE_SUFFIXES:
            continue
        module = _resolve(name)
        rest = name[len(module) + 1 :].split(".") if module and name != module else []
        if module is None or (rest and not _defines(MODULES[module], rest[0])):
            stale.append(name)
    return stale


def test_the_stale_name_check_tells_old_names_from_new() -> None:
    old = "python benchmarks/bench_restart.py; benchmarks.bench_engine; benchmarks.peers_common"
    assert _stale(old) == [
        "benchmarks/bench_restart.py",
        "benchmarks.bench_engine",
        "benchmarks.peers_common",
    ]
    new = "python -m benchmarks.restart; benchmarks.peers.common.make_chunks; benchmarks/tiers.py"
    assert _stale(new) == []


def test_no_file_names_a_benchmark_that_is_gone() -> None:
    """Docs, commands, comments and tests name benchmarks as they are now (``CHANGELOG.md`` is
    history, and keeps the names of its time; this file names old ones to test the check)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not tracked:  # a copy without git: read the files themselves
        tracked = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".git" not in p.parts]
    offenders = []
    for rel in tracked:
        path = ROOT / rel
        if rel == "CHANGELOG.md" or path == Path(__file__) or not path.is_file():
            continue
        if path.suffix in {".gz", ".png", ".svg"}:
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{rel}: {name}" for name in _stale(text)]
    assert not offenders, offenders
