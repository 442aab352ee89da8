"""A miss of tokens stored under another namespace is told apart from one never stored: by
dtype, by block size (engines of 16- and 32-token records share token keys), by tenant; other
causes stand; the alarm warns once; and the index outlives the process through its files."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from cachetier.misses import NamespaceDescriptor
from cachetier.misses.token_file import TokenFiles
from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.store.namespace_watch import ALARM_MIN_LOOKUPS, NamespaceWatch

LAYOUT = KVLayout("float32", 16, 2, 2, 8)
OLD = NamespaceDescriptor.from_namespace(Namespace("model", LAYOUT))
TOKENS = np.random.default_rng(2).integers(0, 30_000, size=16 * 12).tolist()


def _explain(watch: NamespaceWatch, asked: NamespaceDescriptor, record: int = 0) -> str | None:
    miss = watch.explain(asked, TOKENS, record, 12 - record, "never_stored")
    return None if miss is None else miss.detail


def test_a_dtype_mismatch_is_named() -> None:
    watch = NamespaceWatch(1024)
    watch.stored(OLD, TOKENS)
    detail = _explain(watch, dataclasses.replace(OLD, dtype="bfloat16"))
    assert detail == "dtype 'bfloat16' asked, 'float32' held"
    assert _explain(watch, OLD) is None  # the namespace that stored them: not a mismatch


@pytest.mark.parametrize(("stored", "asked"), [(16, 32), (32, 16), (16, 256)])
def test_engines_of_other_block_sizes_find_each_others_tokens(stored: int, asked: int) -> None:
    watch = NamespaceWatch(1024)
    watch.stored(dataclasses.replace(OLD, record_tokens=stored), TOKENS * 2)
    detail = _explain(watch, dataclasses.replace(OLD, record_tokens=asked))
    assert detail is not None and detail.startswith("block size")


def test_a_miss_past_a_partial_hit_and_a_tenant_mismatch() -> None:
    watch = NamespaceWatch(1024)
    watch.stored(dataclasses.replace(OLD, tenant="a"), TOKENS)
    detail = _explain(watch, dataclasses.replace(OLD, tenant="b"), record=5)
    assert detail == "tenant 'b' asked, 'a' held"


def test_causes_the_store_saw_stand_and_unseen_tokens_stay_never_stored() -> None:
    watch = NamespaceWatch(1024)
    watch.stored(OLD, TOKENS[:64])
    asked = dataclasses.replace(OLD, dtype="bfloat16")
    assert watch.explain(asked, TOKENS, 0, 12, "evicted") is None
    assert _explain(watch, asked, record=6) is None  # record 6 was never stored by anyone
    assert watch.explain(asked, TOKENS[:8], 0, 1, "never_stored") is None  # no full record


def test_the_alarm_warns_once_when_mismatches_dominate(caplog: pytest.LogCaptureFixture) -> None:
    watch = NamespaceWatch(1024, alarm_share=0.5)
    watch.stored(OLD, TOKENS)
    asked = dataclasses.replace(OLD, dtype="bfloat16", format_version=OLD.format_version + 1)
    with caplog.at_level(logging.WARNING, logger="cachetier.misses"):
        for _ in range(3 * ALARM_MIN_LOOKUPS):
            _explain(watch, asked)
    (record,) = caplog.records
    assert "dtype 'bfloat16' asked, 'float32' held" in record.getMessage()
    assert "record format version" in record.getMessage()


def test_a_new_process_on_the_folder_knows_what_the_old_one_held(tmp_path: Path) -> None:
    old = NamespaceWatch(1024, files=TokenFiles(tmp_path / "idx"))
    old.stored(OLD, TOKENS)
    old.close()  # a graceful shutdown saves
    new = NamespaceWatch(1024, files=TokenFiles(tmp_path / "idx"))
    assert _explain(new, dataclasses.replace(OLD, dtype="bfloat16")) is not None
