"""A token index kept in files: what one process saved, another merges at its start; files of
another size, version or shape, torn or oversized, are skipped with a log line, never
trusted; the folder keeps at most ``MAX_FILES``."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from cachetier.misses import NamespaceDescriptor, TokenIndex, token_keys
from cachetier.misses.token_file import MAX_FILES, TokenFiles
from cachetier.primitives.keys import KVLayout, Namespace

LAYOUT = KVLayout("bfloat16", 16, 4, 2, 64)
OLD = NamespaceDescriptor.from_namespace(Namespace("model-a", LAYOUT, tenant="acme"))
NEW = dataclasses.replace(OLD, dtype="float16")
KEYS = token_keys(np.random.default_rng(1).integers(0, 50_000, size=16 * 30), 16)


def _saved(folder: Path, slots: int = 1024) -> TokenFiles:
    index = TokenIndex(slots)
    index.note(KEYS, OLD)
    files = TokenFiles(folder)
    files.save(index)
    return files


def test_another_process_finds_what_one_saved(tmp_path: Path) -> None:
    _saved(tmp_path / "idx")
    later = TokenIndex(1024)
    assert TokenFiles(tmp_path / "idx").load_into(later) == len(KEYS)
    assert later.holders(KEYS, NEW) == [OLD] * len(KEYS)
    assert later.holder(KEYS[0], OLD) is None  # its own namespace is no mismatch
    assert later.descriptors == (OLD,)


def test_a_process_does_not_merge_its_own_file(tmp_path: Path) -> None:
    files = _saved(tmp_path / "idx")
    assert files.load_into(TokenIndex(1024)) == 0


def test_files_of_another_size_or_torn_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "idx"
    _saved(folder, slots=4096)  # another table size: its sets mean nothing here
    (folder / "torn.npz").write_bytes(b"PK\x03\x04 not a zip at all")
    good = _saved(folder)
    text = good.path.read_bytes()
    (folder / "cut.npz").write_bytes(text[: len(text) // 2])
    later = TokenIndex(1024)
    with caplog.at_level(logging.WARNING, logger="cachetier.misses"):
        assert TokenFiles(folder).load_into(later) == len(KEYS)  # the good file only
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 3 and all("skipped" in m for m in skipped)
    assert any("4096" in m for m in skipped)


def test_entries_that_point_past_the_descriptors_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    files = _saved(folder)
    with np.load(files.path) as data:
        arrays = {name: data[name] for name in data.files}
    arrays["ids"] = arrays["ids"] + np.uint16(5)  # no such descriptor
    np.savez(folder / "forged.npz", **arrays)
    os.unlink(files.path)
    assert TokenFiles(folder).load_into(TokenIndex(1024)) == 0


def test_the_folder_keeps_at_most_max_files(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    for _ in range(MAX_FILES + 4):
        _saved(folder)
    assert len(list(folder.iterdir())) == MAX_FILES


def test_an_unwritable_folder_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="cachetier.misses"):
        TokenFiles(blocker / "idx").save(TokenIndex(64))
    assert "not saved" in caplog.text
