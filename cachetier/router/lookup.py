"""``POST /v1/fleet/lookup``: the router's prefix index, asked by anyone.

A scheduler of its own (llm-d's, Dynamo's, a batch planner) can ask where a prompt's KV is
without sending the prompt through the router: for each replica, the leading blocks held and
the fastest medium of each, as the router itself weighs them. The prompt is given as a
completion or chat request body is (``prompt`` as token ids or text, or ``messages``), and
tokenized as the router tokenizes requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import block_keys
from cachetier.router.replicas import Replica


def lookup_answer(index: PrefixIndex, replicas: Sequence[Replica], tokens: list[int]) -> dict:
    """Each replica's holding of ``tokens``' blocks, keyed under the namespace it reports.

    Args:
        index: the router's prefix index.
        replicas: every replica (those down hold nothing: the index forgot them).
        tokens: the prompt's token ids.

    Returns:
        ``{"num_tokens", "replicas": {name: {"up", "block_size", "num_blocks",
        "cached_tokens", "spans": [{"medium", "blocks"}]}}}``; a replica that has not
        reported its namespace yet answers ``num_blocks`` 0 and ``block_size`` null.
    """
    out: dict[str, Any] = {}
    for replica in replicas:
        namespace = replica.namespace
        if namespace is None:
            out[replica.name] = _entry(replica, None, 0, [])
            continue
        (held,) = index.holdings(block_keys(namespace, tokens), [replica.name])
        spans = [{"medium": medium, "blocks": n} for medium, n in held.spans()]
        out[replica.name] = _entry(replica, namespace.block_size, held.num_blocks, spans)
    return {"num_tokens": len(tokens), "replicas": out}


def _entry(
    replica: Replica, block_size: int | None, num_blocks: int, spans: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "up": replica.up,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "cached_tokens": num_blocks * (block_size or 0),
        "spans": spans,
    }
