"""The fixed cause list and the value that carries one; and what the package may import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cachetier.misses
from cachetier.misses import LEDGER_CAUSES, MISS_CAUSES, MissCause

# cachetier.misses sits beside the tiers (tests/test_architecture.py), but reads nothing of
# them: the store feeds it, so that it stays a set of plain structures.
ALLOWED = ("cachetier.errors", "cachetier.util", "cachetier.primitives", "cachetier.record")


def test_the_causes_are_fixed_and_in_order() -> None:
    assert MISS_CAUSES == (
        "never_stored",
        "evicted",
        "not_admitted",
        "write_dropped",
        "namespace_mismatch",
        "corrupt",
        "too_slow",
        "tier_down",
        "partial_block",
        "quarantined",
    )
    assert set(LEDGER_CAUSES) < set(MISS_CAUSES)


def test_a_miss_cause_checks_what_it_carries() -> None:
    assert MissCause("never_stored") == MissCause("never_stored", "", None, "")
    assert MissCause("evicted", "disk", 12.5, "3 s ago").age_s == 12.5
    with pytest.raises(ValueError, match="cause 'gone' is not one of"):
        MissCause("gone")
    with pytest.raises(ValueError, match="age_s must be >= 0"):
        MissCause("evicted", "disk", -1.0)
    with pytest.raises(TypeError, match="tier must be a tier name"):
        MissCause("evicted", None)  # type: ignore[arg-type]


def test_the_package_imports_only_the_layers_below_the_tiers() -> None:
    folder = Path(cachetier.misses.__file__).parent
    bad = []
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            bad += [
                f"{path.name}: {n}"
                for n in names
                if n.startswith("cachetier") and not n.startswith(("cachetier.misses", *ALLOWED))
            ]
    assert not bad, bad
