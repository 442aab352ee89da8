from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from cachetier.primitives.keys import (
    DTYPE_BYTES,
    KVLayout,
    Namespace,
    block_keys,
    dtype_name,
    foreign_key,
    hash_block,
    num_leading_hits,
    parse_key,
    token_bytes,
    torch_dtype,
)
from cachetier.primitives.kv_format import MLA_ARRANGEMENT

LAYOUT = KVLayout("float16", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
NS = Namespace("model-a", LAYOUT)


def test_only_full_blocks_get_keys() -> None:
    assert len(block_keys(NS, list(range(11)))) == 2
    assert len(block_keys(NS, list(range(12)))) == 3
    assert block_keys(NS, [1, 2, 3]) == []


def test_key_is_the_documented_chain() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    keys = block_keys(NS, tokens)
    k0 = hashlib.sha256(NS.fingerprint + np.array(tokens[:4], "<u4").tobytes()).digest()
    k1 = hashlib.sha256(k0 + np.array(tokens[4:], "<u4").tobytes()).digest()
    assert keys == [k0, k1]
    assert hash_block(k0, tokens[4:]) == k1


def test_chain_means_a_changed_early_token_changes_every_later_key() -> None:
    a = block_keys(NS, list(range(12)))
    b = block_keys(NS, [99] + list(range(1, 12)))
    assert all(x != y for x, y in zip(a, b))


def test_prefix_keys_are_shared_and_parent_continues_a_chain() -> None:
    tokens = list(range(40))
    full = block_keys(NS, tokens)
    assert block_keys(NS, tokens[:20]) == full[:5]
    assert block_keys(NS, tokens[20:], parent=full[4]) == full[5:]


def test_input_types_agree() -> None:
    tokens = list(range(16))
    ref = block_keys(NS, tokens)
    assert block_keys(NS, np.array(tokens, dtype=np.int64)) == ref
    assert block_keys(NS, torch.tensor(tokens)) == ref
    assert block_keys(NS, tuple(tokens)) == ref


@pytest.mark.parametrize(
    "other",
    [
        Namespace("model-b", LAYOUT),
        Namespace("model-a", LAYOUT, tenant="acme"),
        Namespace("model-a", KVLayout("float32", 4, 2, 1, 8)),
        Namespace("model-a", KVLayout("float16", 4, 3, 1, 8)),
        Namespace("model-a", KVLayout("float16", 4, 2, 1, 8, arrangement=MLA_ARRANGEMENT)),
    ],
)
def test_namespace_parts_all_change_the_keys(other: Namespace) -> None:
    tokens = list(range(8))
    assert set(block_keys(NS, tokens)).isdisjoint(block_keys(other, tokens))


def test_block_size_changes_the_keys() -> None:
    other = Namespace("model-a", KVLayout("float16", 8, 2, 1, 8))
    assert block_keys(NS, list(range(8)))[1] != block_keys(other, list(range(8)))[0]


def test_extra_keys_change_only_their_block_onwards() -> None:
    tokens = list(range(12))
    plain = block_keys(NS, tokens)
    extra = block_keys(NS, tokens, extra_keys=[b"", b"lora-1", b""])
    assert extra[0] == plain[0]
    assert extra[1] != plain[1] and extra[2] != plain[2]
    with pytest.raises(ValueError, match="extra_keys"):
        block_keys(NS, tokens, extra_keys=[b""])


def test_num_leading_hits() -> None:
    keys = block_keys(NS, list(range(20)))
    assert num_leading_hits(keys, set(keys[:3])) == 3
    assert num_leading_hits(keys, {keys[0], keys[2]}) == 1
    assert num_leading_hits(keys, set()) == 0
    assert num_leading_hits(keys, lambda k: k != keys[4]) == 4


@pytest.mark.parametrize(
    "bad, error",
    [([-1, 2], ValueError), ([2**32], ValueError), ([[1, 2]], ValueError), ([1.5], TypeError)],
)
def test_bad_tokens_are_rejected(bad: list, error: type[Exception]) -> None:
    with pytest.raises(error):
        token_bytes(bad)


def test_bad_layout_and_namespace_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("float64", 4, 1, 1, 1)
    with pytest.raises(ValueError, match="block_size"):
        KVLayout("float16", 0, 1, 1, 1)
    with pytest.raises(ValueError, match="model_fingerprint"):
        Namespace("", LAYOUT)


def test_parse_key_round_trips_and_rejects_bad_text() -> None:
    key = block_keys(NS, list(range(4)))[0]
    assert parse_key(key.hex()) == key
    with pytest.raises(ValueError):
        parse_key("ab")
    with pytest.raises(ValueError):
        parse_key("zz" * 32)


_CHILD = """
import sys
from cachetier.primitives.keys import KVLayout, Namespace, block_keys
ns = Namespace("model-a", KVLayout("float16", 4, 2, 1, 8), tenant="t")
print(",".join(k.hex() for k in block_keys(ns, list(range(1000, 1040)))))
"""


def test_two_processes_with_different_hash_seeds_agree() -> None:
    outs = []
    for seed in ("1", "12345"):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        )
        outs.append(proc.stdout.strip())
    ns = Namespace("model-a", KVLayout("float16", 4, 2, 1, 8), tenant="t")
    here = ",".join(k.hex() for k in block_keys(ns, list(range(1000, 1040))))
    assert outs[0] == outs[1] == here
    assert len(here.split(",")) == 10


@pytest.mark.parametrize("name", sorted(DTYPE_BYTES))
def test_every_layout_dtype_is_a_torch_dtype_of_its_size(name: str) -> None:
    dtype = torch_dtype(name)
    assert isinstance(dtype, torch.dtype)
    assert dtype.itemsize == DTYPE_BYTES[name]
    assert dtype_name(dtype) == name


def test_dtype_names_refuse_what_no_layout_holds() -> None:
    with pytest.raises(ValueError, match="float64"):
        torch_dtype("float64")
    with pytest.raises(ValueError, match="torch.float64"):
        dtype_name(torch.float64)


def test_foreign_keys_are_scoped_by_namespace_and_engine() -> None:
    page = "ab" * 32  # an engine's own name for a block (SGLang: its page hash)
    key = foreign_key(NS, "sglang", page)
    assert len(key) == 32 and key == foreign_key(NS, "sglang", page.encode())
    others = {
        foreign_key(Namespace("model-b", LAYOUT), "sglang", page),
        foreign_key(Namespace("model-a", LAYOUT, tenant="acme"), "sglang", page),
        foreign_key(NS, "lmcache", page),
        foreign_key(NS, "sglang", page[:-1] + "c"),
    }
    assert key not in others and len(others) == 4
    for engine, name in (("", page), ("a\0b", page), ("sglang", "")):
        with pytest.raises(ValueError):
            foreign_key(NS, engine, name)


def test_record_layout_keeps_the_kv_and_takes_the_record_size() -> None:
    from cachetier.primitives.keys import record_layout, records_per_block

    vllm = KVLayout("float16", 32, 30, 3, 64)
    hf = KVLayout("float16", 16, 30, 3, 64)
    assert record_layout(vllm, 16) == hf == record_layout(hf, 16)
    # So the namespace, and every key, is the same whatever the engine's block size.
    assert Namespace("m", record_layout(vllm, 16)).id == Namespace("m", hf).id
    assert records_per_block(64, 16) == 4 and records_per_block(16, 16) == 1
    with pytest.raises(ValueError, match="not a multiple of record_tokens 16"):
        records_per_block(24, 16)
    with pytest.raises(ValueError, match="record_tokens"):
        records_per_block(16, 0)
