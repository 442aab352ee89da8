"""One namespace checker for every tier, the sidecar's clients included (``check_namespace``)."""

from __future__ import annotations

import pytest

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.tiers.base import MAX_NAMESPACE_CHARS, check_namespace

LAYOUT = KVLayout("float16", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def test_every_namespace_the_sidecar_ever_stored_still_qualifies() -> None:
    # The sidecar once allowed its clients 80 characters under "t.<tenant of up to 32>.".
    longest_stored = "t." + "T" * 32 + "." + "n" * 80
    assert check_namespace(longest_stored) == longest_stored
    assert check_namespace("x" * MAX_NAMESPACE_CHARS) == "x" * MAX_NAMESPACE_CHARS
    namespace_id = Namespace("model-a", LAYOUT).id
    assert check_namespace(namespace_id, prefix="t." + "T" * 32 + ".") == namespace_id


@pytest.mark.parametrize(
    "bad", ["", "x" * (MAX_NAMESPACE_CHARS + 1), ".hidden", "-dash", "a/b", "ns\n", "sp ace"]
)
def test_a_bad_namespace_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="must be 1-128 characters"):
        check_namespace(bad)


def test_a_prefix_and_its_namespace_share_the_limit() -> None:
    prefix = "t.alice."
    fits = "a" * (MAX_NAMESPACE_CHARS - len(prefix))
    assert check_namespace(fits, prefix=prefix) == fits
    with pytest.raises(ValueError, match=f"at most {len(fits)} fit"):
        check_namespace(fits + "a", prefix=prefix)


def test_a_namespace_checked_once_is_still_checked_against_a_prefix_and_others_still_fail() -> None:
    # Namespaces that passed are remembered (a get checks one per call): that must not let a
    # prefixed one past the shared limit, nor a bad one past the pattern.
    longest = "r" * MAX_NAMESPACE_CHARS
    assert check_namespace(longest) == longest
    assert check_namespace(longest) == longest  # remembered
    with pytest.raises(ValueError, match="fit"):
        check_namespace(longest, prefix="t.a.")
    for bad in ("ns\n", longest + "r"):
        with pytest.raises(ValueError, match="must be 1-128 characters"):
            check_namespace(bad)


def test_a_str_subclass_is_checked_every_time() -> None:
    class Sneaky(str):
        pass

    ok = Sneaky("model-x")
    assert check_namespace(ok) == ok
    with pytest.raises(ValueError):
        check_namespace(Sneaky("bad/one"))
