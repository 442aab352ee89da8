"""The code's shape, as figures that can regress: repeated code, long functions, large files.

    python -m benchmarks.shape --json

Last line:
- ``duplicate_pairs``: pairs of places in the Python sources (product, tests, benchmarks) that
  share a run of ``--min-lines`` (6) or more code lines, the same once whitespace, comments,
  docstrings, imports and decorators are set aside; ``duplicate_pairs_by_shape`` counts runs
  that are the same once strings and numbers are also set aside (a place to look, not always a
  fault: two tests may rightly call one helper with other values).
- ``longest_function_lines`` (docstring included) and ``largest_file_lines`` in the product
  packages (``cachetier``, ``engine``, ``connectors``, ``kernels``), with where they are.
- ``architecture_rules``: the rules ``tests/test_architecture.py`` checks (its test functions).

Targets (issue 14): no duplicate pair, no function over 80 lines, no file over 500 lines.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

from benchmarks.support.children import REPO_ROOT
from benchmarks.support.output import emit

PRODUCT = ("cachetier", "engine", "connectors", "kernels")
SCANNED = (*PRODUCT, "tests", "benchmarks")
_NUMBER = re.compile(r"\b\d[\d_.]*\b")
_STRING = re.compile(r"(?:[rbuf]{0,2})(\"[^\"]*\"|'[^']*')")
# Lines that say nothing on their own: a run made of them alone is no duplicate.
_THIN = re.compile(
    r"^[\s()\[\]{}:,.]*$"  # brackets and commas
    r"|^(return|pass|else :|try :|finally :|\) -> .*:)$"  # keywords alone
    r"|^((?:[rbuf]{0,2})(\"[^\"]*\"|'[^']*')|S|0|[\d_.]+)\s*[,:]?.{0,12}$"  # one literal: data
)


def sources(folders: tuple[str, ...]) -> list[Path]:
    """Every ``.py`` file under the given top-level folders, sorted."""
    return sorted(p for folder in folders for p in (REPO_ROOT / folder).rglob("*.py"))


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each line that holds code: comments, blank lines, docstrings,
    imports and decorators left out, tokens joined by one space."""
    text = path.read_text(encoding="utf-8")
    skip: set[int] = set()
    for node in ast.walk(ast.parse(text, str(path))):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            for deco in getattr(node, "decorator_list", ()):
                skip.update(range(deco.lineno, (deco.end_lineno or deco.lineno) + 1))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                skip.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    by_line: dict[int, list[str]] = defaultdict(list)
    quiet = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in quiet or tok.type == tokenize.ENDMARKER or tok.start[0] in skip:
            continue
        by_line[tok.start[0]].append(tok.string)
    return [(number, " ".join(parts)) for number, parts in sorted(by_line.items())]


def shape_of(line: str) -> str:
    """A line with its strings and numbers replaced by placeholders: the same code with other
    values (names are kept: renaming every name makes most short lines alike)."""
    return _NUMBER.sub("0", _STRING.sub("S", line))


def duplicate_pairs(files: list[Path], min_lines: int, by_shape: bool) -> list[str]:
    """Pairs of places sharing ``min_lines`` consecutive code lines.

    Args:
        files: the files to compare (each with itself too).
        min_lines: the shortest run that counts.
        by_shape: compare the lines' shapes instead of their text.

    Returns:
        One ``a.py:line ~ b.py:line`` per pair of (file, file) regions, the first run of each.
    """
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path in files:
        lines = code_lines(path)
        texts = [shape_of(t) if by_shape else t for _, t in lines]
        rel = str(path.relative_to(REPO_ROOT))
        for i in range(len(lines) - min_lines + 1):
            window = tuple(texts[i : i + min_lines])
            if sum(1 for t in window if not _THIN.match(t)) < min_lines - 1:
                continue
            windows[window].append((rel, lines[i][0]))
    seen: dict[tuple[str, str], tuple[int, int]] = {}
    for places in windows.values():
        if len(places) < 2 or len(places) > 8:  # over 8: a common idiom, not a copy
            continue
        for a in range(len(places)):
            for b in range(a + 1, len(places)):
                (fa, la), (fb, lb) = places[a], places[b]
                if fa == fb and abs(la - lb) < min_lines:
                    continue  # a run overlapping itself
                key = (fa, fb) if (fa, la) <= (fb, lb) else (fb, fa)
                seen.setdefault(key, (la, lb))
    return [f"{a}:{la} ~ {b}:{lb}" for (a, b), (la, lb) in sorted(seen.items())]


def longest_function(files: list[Path]) -> tuple[int, str]:
    """The longest function or method, docstring and decorators' line excluded, as
    (lines, ``file:line name``)."""
    best = (0, "")
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > best[0]:
                    where = f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}"
                    best = (lines, where)
    return best


def largest_file(files: list[Path]) -> tuple[int, str]:
    """The file with the most lines, as (lines, path)."""
    sizes = [
        (len(p.read_text(encoding="utf-8").splitlines()), str(p.relative_to(REPO_ROOT)))
        for p in files
    ]
    return max(sizes) if sizes else (0, "")


def architecture_rules() -> list[str]:
    """The test functions of ``tests/test_architecture.py``: one rule each."""
    tree = ast.parse((REPO_ROOT / "tests" / "test_architecture.py").read_text(encoding="utf-8"))
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--min-lines", type=int, default=6, help="shortest repeated run")
    parser.add_argument("--list", action="store_true", help="print every duplicate pair")
    args = parser.parse_args()
    scanned = sources(SCANNED)
    product = sources(PRODUCT)
    exact = duplicate_pairs(scanned, args.min_lines, by_shape=False)
    shaped = duplicate_pairs(scanned, args.min_lines, by_shape=True)
    if args.list:
        for row in exact:
            print("same:", row, file=sys.stderr)
        for row in shaped:
            print("shape:", row, file=sys.stderr)
    longest, longest_at = longest_function(product)
    largest, largest_at = largest_file(product)
    rules = architecture_rules()
    result = {
        "duplicate_pairs": len(exact),
        "duplicate_pairs_by_shape": len(shaped),
        "longest_function_lines": longest,
        "longest_function": longest_at,
        "largest_file_lines": largest,
        "largest_file": largest_at,
        "architecture_rules": len(rules),
        "architecture_rule_names": rules,
        "files_scanned": len(scanned),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
