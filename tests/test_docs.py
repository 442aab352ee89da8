"""The generated doc pages match their generators, so a changed config class or a new
benchmark result cannot leave the docs behind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader, f"scripts/{name}.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_generated_from_the_config_classes() -> None:
    gen = load_script("gen_config_doc")
    assert (ROOT / "docs" / "configuration.md").read_text() == gen.render(), (
        "docs/configuration.md is stale: run python scripts/gen_config_doc.py"
    )


def test_configuration_page_lists_every_field_with_its_description() -> None:
    gen = load_script("gen_config_doc")
    page = gen.render()
    from cachetier.connectors.config import SETTINGS as CONNECTOR
    from cachetier.server.config import SETTINGS as SERVER

    for name in {**CONNECTOR, **SERVER}:
        assert page.count(f"| `{name}` |") == 1, f"{name}: one row per setting"
    assert "not described in the docstring" not in page


def test_args_sections_are_parsed_with_continuation_lines() -> None:
    gen = load_script("gen_config_doc")
    doc = (
        "Summary line.\n\nArgs:\n    a: first,\n        continued.\n    b (int): second.\n\n"
        "Returns:\n    nothing.\n"
    )
    summary, args = gen.parse_args_section(doc)
    assert summary == "Summary line."
    assert args == {"a": "first, continued.", "b": "second."}


def test_benchmarks_page_is_generated_from_the_results() -> None:
    gen = load_script("gen_benchmarks_doc")
    assert (ROOT / "docs" / "benchmarks.md").read_text() == gen.render(), (
        "docs/benchmarks.md is stale: run python scripts/gen_benchmarks_doc.py"
    )


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "results").glob("*.json")), ids=str)
def test_every_result_says_where_it_ran_and_how_to_rerun_it(path: Path) -> None:
    data = json.loads(path.read_text())
    for key in ("machine", "commit", "command"):
        assert data.get(key), f"{path.name} lacks {key!r}"
    assert len(data["commit"]) == 40, "commit: a full hash"


def test_a_result_without_provenance_is_refused(tmp_path: Path) -> None:
    gen = load_script("gen_benchmarks_doc")
    (tmp_path / "bench_x.json").write_text(json.dumps({"speedup": 2.0}))
    with pytest.raises(ValueError, match="machine"):
        gen.render(tmp_path)
    (tmp_path / "bench_x.json").write_text(
        json.dumps({"speedup": 2.0, "machine": "m", "commit": "c" * 40, "command": "run it"})
    )
    page = gen.render(tmp_path)
    assert "| `speedup` | 2 |" in page and "Rerun: `run it`" in page
