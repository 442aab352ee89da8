"""Token-only keys and the index of who stored them: the same tokens keyed alike under every
namespace, a holder found only under another namespace than the one asking, the differing
parts named, a bounded table, several threads, and its size at a million keys."""

from __future__ import annotations

import dataclasses
import random
import threading

import numpy as np
import pytest

from cachetier.misses import NamespaceDescriptor, TokenIndex, token_keys
from cachetier.misses.table import SMALL_BATCH, WAYS
from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys
from cachetier.record import FORMAT_VERSION

LAYOUT = KVLayout("bfloat16", 16, 4, 2, 64)
OLD = NamespaceDescriptor.from_namespace(Namespace("model-a" * 8, LAYOUT, tenant="acme"))
NEW = dataclasses.replace(OLD, dtype="float16")
TOKENS = np.random.default_rng(0).integers(0, 50_000, size=16 * 40)


def test_token_keys_are_the_same_under_every_namespace_and_differ_from_block_keys() -> None:
    keys = token_keys(TOKENS, 16)
    assert len(keys) == 40 and all(len(k) == 32 for k in keys)
    assert token_keys(TOKENS[:-3], 16) == keys[:-1]  # a partial last record gets none
    assert token_keys(list(TOKENS[: 16 * 5]), 16) == keys[:5]  # a prefix keys a prefix
    other = Namespace("model-b", dataclasses.replace(LAYOUT, dtype="float16"))
    assert not set(keys) & set(block_keys(other, TOKENS))
    assert token_keys(TOKENS, 32) != keys[:20]  # the record size is part of the chain
    assert token_keys(TOKENS[:32], 16, extra_keys=[b"lora-1", b"lora-1"]) != keys[:2]


def test_a_holder_is_found_only_under_another_namespace() -> None:
    index = TokenIndex(1024)
    keys = token_keys(TOKENS, 16)
    assert index.note(keys[:20], OLD) == 20
    assert index.holder(keys[3], NEW) == OLD
    assert index.holder(keys[3], OLD) is None  # the asker's own blocks are no mismatch
    assert index.holder(keys[25], NEW) is None  # never stored by anyone
    assert index.holders(keys[18:22], NEW) == [OLD, OLD, None, None]
    index.note(keys[:20], NEW)  # both hold the same tokens now: two entries a key
    assert len(index) == 40
    assert index.holder(keys[3], OLD) == NEW and index.holder(keys[3], NEW) == OLD
    third = dataclasses.replace(OLD, tenant="globex")
    assert index.holder(keys[3], third) in (OLD, NEW)
    assert index.descriptors == (OLD, NEW)


def test_the_parts_that_differ_are_named() -> None:
    changed = {
        "model_fingerprint": "model-b-fingerprint-digest",
        "dtype": "float16",
        "record_tokens": 32,
        "arrangement": "mla",
        "kv_shape": (4, 8, 64),
        "format_version": FORMAT_VERSION + 1,
        "tenant": "globex",
    }
    for part, value in changed.items():
        assert OLD.differs_from(dataclasses.replace(OLD, **{part: value})) == [part]
    both = dataclasses.replace(OLD, dtype="float16", tenant="")
    assert OLD.differs_from(both) == ["dtype", "tenant"]
    assert OLD.differs_from(OLD) == []
    text = OLD.describe_difference(both)
    assert text == "dtype 'bfloat16' asked, 'float16' held; tenant 'acme' asked, '' held"
    assert "model fingerprint 'model-amodel-amo...' asked" in OLD.describe_difference(
        dataclasses.replace(OLD, model_fingerprint="x")
    )
    assert OLD.describe_difference(OLD) == "nothing differs"


def test_a_descriptor_is_the_namespace_part_by_part() -> None:
    assert OLD == NamespaceDescriptor(
        model_fingerprint="model-a" * 8,
        dtype="bfloat16",
        record_tokens=16,
        arrangement=LAYOUT.arrangement,
        format_version=FORMAT_VERSION,
        tenant="acme",
        kv_shape=(4, 2, 64),
    )


def test_the_table_is_bounded_and_replaces_a_full_sets_oldest_entry() -> None:
    index = TokenIndex(WAYS)  # one set
    keys = token_keys(TOKENS, 16)[: WAYS + 1]
    index.note(keys, OLD)
    assert index.holders(keys, NEW) == [None] + [OLD] * WAYS
    assert len(index) == WAYS


def test_the_batch_path_answers_as_the_per_key_path_does() -> None:
    rng = random.Random(2)
    keys = [BlockHash(rng.randbytes(32)) for _ in range(2000)]
    descs = [dataclasses.replace(OLD, tenant=f"t{i}") for i in range(5)]
    per_key, batched = TokenIndex(256), TokenIndex(256)
    for n, start in enumerate(range(0, len(keys), 50)):
        chunk = keys[start : start + 50] + keys[start : start + 5]  # repeats within a batch
        batched.note(chunk, descs[n % 5])
        for key in chunk:
            per_key.note([key], descs[n % 5])
    for asking in (descs[0], NEW):
        assert batched.holders(keys, asking) == per_key.holders(keys, asking)
        assert [batched.holder(k, asking) for k in keys[:SMALL_BATCH]] == batched.holders(
            keys[:SMALL_BATCH], asking
        )


def test_past_max_descriptors_a_new_namespace_is_not_noted() -> None:
    index = TokenIndex(64, max_descriptors=2)
    keys = token_keys(TOKENS, 16)
    assert index.note(keys[:2], OLD) == 2 and index.note(keys[2:4], NEW) == 2
    assert index.note(keys[4:6], dataclasses.replace(OLD, tenant="late")) == 0
    assert index.note(keys[6:8], OLD) == 2  # known ones still are
    assert index.holder(keys[4], OLD) is None


def test_notes_and_lookups_on_several_threads() -> None:
    # Key i sits in set i, whose four ways take its four namespaces: nothing is replaced.
    keys = [
        BlockHash((i + 1).to_bytes(8, "little") + i.to_bytes(24, "little")) for i in range(2000)
    ]
    index = TokenIndex(WAYS * len(keys))
    descs = [dataclasses.replace(OLD, tenant=f"t{i}") for i in range(4)]
    errors: list[BaseException] = []

    def write(t: int) -> None:
        try:
            for start in range(0, len(keys), 40):
                index.note(keys[start : start + 40], descs[t])
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            for _ in range(100):
                for held in index.holders(keys[::50], NEW):
                    assert held is None or held in descs
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert set(index.descriptors) == set(descs)
    assert all(held in descs for held in index.holders(keys, NEW))
    assert all(held in descs[1:] for held in index.holders(keys, descs[0]))


def test_its_memory_at_a_million_keys_is_the_docstring_formula() -> None:
    assert TokenIndex(1_000_000).nbytes == 10 * 1_000_000 + 1_000_000 // WAYS == 10_250_000


def test_bad_arguments_are_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="tracked_keys must be a positive int"):
        TokenIndex(0)
    with pytest.raises(ValueError, match="max_descriptors must be <= 65535"):
        TokenIndex(8, max_descriptors=1 << 16)
    index = TokenIndex(8)
    with pytest.raises(TypeError, match="descriptor must be a NamespaceDescriptor"):
        index.note([], "model-a")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="asking must be a NamespaceDescriptor"):
        index.holder(token_keys(TOKENS, 16)[0], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block key is 32 bytes"):
        index.note([BlockHash(b"short")], OLD)
    with pytest.raises(TypeError, match="other must be a NamespaceDescriptor"):
        OLD.differs_from("float16")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_fingerprint": ""}, "model_fingerprint must be a non-empty string"),
        ({"dtype": "float64"}, "dtype 'float64' is not one of"),
        ({"record_tokens": 0}, "record_tokens must be a positive int"),
        ({"arrangement": ""}, "arrangement must be a non-empty string"),
        ({"format_version": 0}, "format_version must be a positive int"),
        ({"tenant": None}, "tenant must be a str"),
        ({"kv_shape": (4, 2)}, "kv_shape must be"),
        ({"kv_shape": (4, 0, 64)}, "kv_shape entry must be a positive int"),
    ],
)
def test_a_bad_descriptor_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        dataclasses.replace(OLD, **change)
