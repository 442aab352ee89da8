"""A JSON file replaced whole: the new document or the old one, never a half, and no litter; and
read back within a bound."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cachetier.util.json_file import read_json, replace_json


def test_a_document_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    replace_json(path, {"a": 1}, 0o600, fsync=True)
    replace_json(path, {"a": 2}, 0o600)
    assert json.loads(path.read_text()) == {"a": 2}
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    replace_json(path, {"a": 1}, 0o600)
    with pytest.raises(ValueError):
        replace_json(path, {"a": math.nan}, 0o600)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_read_is_bounded_and_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    assert read_json(path, 100) is None  # missing
    replace_json(path, {"a": 1}, 0o600)
    assert read_json(path, 100) == {"a": 1}
    with pytest.raises(ValueError, match="larger than 4 bytes"):
        read_json(path, 4)
    for text in ("{not json", "[" * 100_000):  # a broken and a too-deep document
        path.write_text(text)
        with pytest.raises(ValueError, match="not JSON"):
            read_json(path, 1 << 20)
