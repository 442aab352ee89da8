"""Settings of an engine's use of the store, declared once for every engine.

Our engine's ``EngineConfig`` and the plugins' ``ConnectorConfig`` both have a tenant, a load
policy and a record size. Each declares those fields with the functions here (a
``dataclasses.Field`` belongs to one class, so each call makes a fresh one), so each setting
has one name, one default and one description (``cachetier.util.settings``).
"""

from __future__ import annotations

from typing import Any

from cachetier.primitives.kv_format import DEFAULT_RECORD_TOKENS
from cachetier.util.settings import setting

# ``cost``: load a tier hit only where that beats recomputing it; ``always``: load every hit.
KV_LOAD_POLICIES = ("cost", "always")


def tenant_setting() -> Any:
    """The ``tenant`` field: who the blocks belong to."""
    return setting(
        "",
        "tenant name, folded into every block key: engines of different tenants never share "
        "blocks (in vLLM, a request's ``cache_salt`` is appended to it).",
    )


def kv_load_policy_setting() -> Any:
    """The ``kv_load_policy`` field: which tier hits are loaded."""
    return setting(
        "cost",
        "``cost`` loads only the part of a tier hit that the measured tier speeds load faster "
        "than the engine recomputes it (``cachetier.store.costmodel``); ``always`` loads every "
        "hit.",
    )


def record_tokens_setting() -> Any:
    """The ``record_tokens`` field: the tokens of one stored record."""
    return setting(
        DEFAULT_RECORD_TOKENS,
        "tokens per stored record, the same in every engine that shares the cache "
        "(``cachetier.primitives.kv_format.DEFAULT_RECORD_TOKENS``); the engine's block size "
        "must be a multiple of it: a block is stored as block size / ``record_tokens`` records.",
    )


def guard_setting() -> Any:
    """The ``guard`` field: whether sampled hits are verified (``cachetier.guard``)."""
    return setting(
        True,
        "verify sampled tier hits: compute them as misses and compare the tier's records with "
        "the computed KV; a mismatch quarantines the records' writer in that tier and "
        "namespace (docs: the restore guard). Our engine and vLLM only: SGLang's and "
        "LMCache's plugins cannot turn a hit into a computed request, and ignore it. On by "
        "default: the first hits of each tier and namespace, and of each writer in them, are "
        "computed once, so a new writer is caught before its records serve an answer; later "
        "hits at guard_fraction.",
    )


def record_check_setting() -> Any:
    """The ``record_check`` field (``cachetier.guard.record_check``)."""
    return setting(
        True,
        "check every restored record before its KV is used: the first layer's K and V of a "
        "few of its tokens, recomputed from the token ids, must match the record's; a record "
        "that fails is a miss, deleted, and its writer quarantined. It catches any record "
        "whose first layer is not that of its tokens (another prompt's KV, K and V swapped, "
        "heads permuted, a first layer zeroed), not one that changes deeper layers only (the "
        "guard's draws catch those). Our engine, vLLM and the HF connector: SGLang's and "
        "LMCache's plugins are not given a read's tokens, and ignore it. Llama-family models "
        "only (llama, mistral, qwen2): the HF connector refuses another family at start while "
        "it is on, vLLM logs a warning and restores unchecked by it.",
    )


def record_check_tokens_setting() -> Any:
    """The ``record_check_tokens`` field."""
    return setting(
        1,
        "with ``record_check``: tokens of each record recomputed, drawn at random at each "
        "restore (a record wrong at only some of its tokens is caught that often).",
    )


def guard_first_hits_setting() -> Any:
    """The ``guard_first_hits`` field."""
    return setting(1, "with ``guard``: hits verified per tier and namespace after the start.")


def guard_fraction_setting() -> Any:
    """The ``guard_fraction`` field."""
    return setting(0.001, "with ``guard``: the share of later hits verified, at random.")


def check_kv_load_policy(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``KV_LOAD_POLICIES``."""
    if value not in KV_LOAD_POLICIES:
        raise ValueError(f"kv_load_policy must be one of {KV_LOAD_POLICIES}, got {value!r}")
