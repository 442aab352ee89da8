"""``GET /v1/fleet/index`` and ``POST /v1/fleet/lookup``: the router's prefix index, asked by
the router's clients, each for its own tenant.

A scheduler of its own (llm-d's, Dynamo's, a batch planner) can ask where a prompt's KV is
without sending the prompt through the router: for each replica, the leading blocks held and
the fastest medium of each, as the router itself weighs them. The prompt is given as a
completion or chat request body is (``prompt`` as token ids or text, or ``messages``), and
tokenized as the router tokenizes requests (on its prepare threads).

An answer says whether a prompt was computed before, so it is told only about the replicas of
the caller's tenant (by its key: ``RouterConfig.client_keys``; the router's ``api_key`` is
tenant ``""``): a replica of another tenant is left out of the answer, as if it were not there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cachetier.kvindex import PrefixIndex
from cachetier.primitives.keys import block_keys
from cachetier.router.config import RouterConfig
from cachetier.router.http import busy, error, read_body, tenant_or_refusal
from cachetier.router.prompt import BadPromptError, PromptTokens, parse_body
from cachetier.router.replicas import Replica, ReplicaSet
from cachetier.router.work import PrepareBusyError, PrepareQueue

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def lookup_answer(index: PrefixIndex, replicas: Sequence[Replica], tokens: list[int]) -> dict:
    """Each replica's holding of ``tokens``' blocks, keyed under the namespace it reports.

    Args:
        index: the router's prefix index.
        replicas: the replicas to tell of (those down hold nothing: the index forgot them).
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


def of_tenant(replicas: Sequence[Replica], tenant: str) -> list[Replica]:
    """The replicas whose blocks are keyed under ``tenant`` (or that have not said yet: those
    are told as holding nothing)."""
    return [r for r in replicas if r.namespace is None or r.namespace.tenant == tenant]


def add_fleet_routes(
    app: FastAPI,
    config: RouterConfig,
    replicas: ReplicaSet,
    tokens: PromptTokens,
    prepare: PrepareQueue,
    index: PrefixIndex | None,
) -> None:
    """Add the index's two routes to the router's ``app``."""

    @app.get("/v1/fleet/index")
    async def fleet_index(request: Request) -> Response:
        """What the index holds of each of the caller's replicas: epoch and, per medium,
        count and digest."""
        tenant = _tenant_with_index(request, config, index)
        if isinstance(tenant, Response):
            return tenant
        assert index is not None, "refused above"
        names = {r.name for r in of_tenant(replicas.replicas, tenant)}
        return JSONResponse({"replicas": describe_index(index, names)})

    @app.post("/v1/fleet/lookup")
    async def fleet_lookup(request: Request) -> Response:
        """Where a prompt's blocks are held, per replica of the caller's tenant."""
        tenant = _tenant_with_index(request, config, index)
        if isinstance(tenant, Response):
            return tenant
        assert index is not None, "refused above"
        body = await read_body(request, config.max_body_bytes)
        if isinstance(body, Response):
            return body
        visible = of_tenant(replicas.replicas, tenant)

        def work() -> dict | None:
            parsed = parse_body(body)
            path = CHAT_PATH if "messages" in parsed else COMPLETION_PATH
            ids = tokens.of(path, parsed)
            return lookup_answer(index, visible, ids) if ids else None

        try:
            answer = await prepare.run(work)
        except BadPromptError as exc:
            return error(400, str(exc))
        except PrepareBusyError as exc:
            return busy(str(exc))
        if answer is None:
            return error(
                400,
                "no prompt token ids: send 'prompt' as token ids, or text or 'messages' to a "
                "router started with --model",
            )
        return JSONResponse(answer)


def describe_index(index: PrefixIndex, names: set[str]) -> dict[str, dict[str, object]]:
    """Per replica of ``names``: the epoch its blocks are held under and each medium's count
    and digest."""
    out: dict[str, dict[str, object]] = {}
    for name in index.replicas:
        if name not in names:
            continue
        media = {
            medium: {"count": count, "xor": f"{acc:016x}"}
            for medium, (count, acc) in index.digests(name).items()
        }
        out[name] = {"epoch": index.epoch(name), "media": media}
    return out


def _tenant_with_index(
    request: Request, config: RouterConfig, index: PrefixIndex | None
) -> str | Response:
    """The caller's tenant, or the answer to a caller without a key or a router without an
    index."""
    tenant = tenant_or_refusal(request, config)
    if not isinstance(tenant, Response) and index is None:
        return error(404, "this router keeps no prefix index (its policy reads none)")
    return tenant


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
