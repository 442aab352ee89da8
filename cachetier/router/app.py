"""The router's HTTP app: an OpenAI-compatible proxy in front of N engine replicas.

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not) are tokenized
(``prompt``), given to the policy (``decide``: ``cachetier.router.decide``), which orders the
replicas that are up, and forwarded to the first that answers (``proxy``). ``GET /v1/models``
goes to any replica that is up; ``/healthz`` is 200 while one is; ``/metrics`` counts every
decision, retry and refusal. Each decision is logged with its estimates (logger
``cachetier.router``, at debug).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.background import BackgroundTask

from cachetier.kvindex import PrefixIndex
from cachetier.router.config import RouterConfig
from cachetier.router.events import EventFeed
from cachetier.router.lookup import lookup_answer
from cachetier.router.prompt import PromptTokens
from cachetier.router.proxy import NoReplicaError, forward
from cachetier.router.reconcile import Reconciler
from cachetier.router.replicas import Replica, ReplicaSet

log = logging.getLogger("cachetier.router")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The replicas to try, best first, what the policy estimated of each (TTFT, seconds),
    and the prefill work each would take on (added to the chosen one's queue until its
    answer ends)."""

    order: Sequence[Replica]
    estimates: dict[str, float] = field(default_factory=dict)
    work_s: dict[str, float] = field(default_factory=dict)


Decide = Callable[[list[int] | None, str | None, Sequence[Replica]], RouteDecision]
"""(prompt token ids or None, session id or None, the replicas that are up) -> decision."""


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own."""

    def __init__(self, replicas: ReplicaSet, policy: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            "cachetier_router_requests", "requests routed", ["policy", "replica"], registry=r
        )
        self.retries = Counter(
            "cachetier_router_retries", "replicas that failed before answering", registry=r
        )
        self.unrouted = Counter(
            "cachetier_router_unrouted_requests", "requests no replica answered", registry=r
        )
        self.estimate = Histogram(
            "cachetier_router_estimated_ttft_seconds",
            "the chosen replica's estimated time to first token",
            ["policy"],
            registry=r,
        )
        up = Gauge(
            "cachetier_router_replica_up", "1 while in the rotation", ["replica"], registry=r
        )
        for replica in replicas.replicas:
            up.labels(replica.name).set_function(lambda rep=replica: float(rep.up))
        for replica in replicas.replicas:
            self.routed.labels(policy, replica.name)

    def watch_index(self, feed: EventFeed, reconciler: Reconciler) -> None:
        """Export the index's event and reconcile counters."""
        r = self.registry
        for name, help_text, read in (
            ("kv_event_batches", "KV event batches applied", lambda: feed.num_batches),
            ("kv_event_batches_missed", "batches lost for good", lambda: feed.num_missed),
            (
                "index_resyncs",
                "media resynced from a digest mismatch",
                lambda: reconciler.num_resyncs,
            ),
        ):
            Gauge(f"cachetier_router_{name}", help_text, registry=r).set_function(
                lambda read=read: float(read())
            )


class Router:
    """What every request needs: the settings, the replicas, the policy and the metrics."""

    def __init__(self, config: RouterConfig, decide: Decide, prompt: PromptTokens | None) -> None:
        self.config = config
        self.decide = decide
        self.replicas = ReplicaSet(config.replicas, config.replica_api_key, config.poll_interval_s)
        self.metrics = RouterMetrics(self.replicas, config.policy)
        self.tokens = prompt if prompt is not None else PromptTokens(config.model)
        self.headers = {"Content-Type": "application/json"}
        if config.replica_api_key:
            self.headers["Authorization"] = f"Bearer {config.replica_api_key}"
        self.session: aiohttp.ClientSession | None = None

    async def route(self, request: Request) -> Response:
        """Tokenize, decide, forward; the answer streams back as the replica sends it."""
        config, metrics = self.config, self.metrics
        refused = _refusal(request, config)
        if refused is not None:
            return refused
        body = await _body(request, config.max_body_bytes)
        parsed = _json_object(body, config.max_body_bytes)
        if isinstance(parsed, Response):
            return parsed
        assert body is not None
        path = request.url.path
        session_id = request.headers.get("x-session-id") or _str(parsed.get("user"))
        decision = self.decide(self.tokens.of(path, parsed), session_id, self.replicas.up())
        assert self.session is not None, "the lifespan opens the session"
        try:
            answer = await forward(
                self.session, self.replicas, decision.order, path, body, self.headers
            )
            answer.take_work(decision.work_s.get(answer.replica.name, 0.0))
        except NoReplicaError as exc:
            metrics.unrouted.inc()
            return _error(503, str(exc), "server_error")
        self.replicas.count_routed(answer.replica)
        metrics.routed.labels(config.policy, answer.replica.name).inc()
        metrics.retries.inc(answer.retries)
        chosen = decision.estimates.get(answer.replica.name)
        if chosen is not None:
            metrics.estimate.labels(config.policy).observe(chosen)
        log.debug(
            "routed to %s (%s, %d retries): estimates %s",
            answer.replica.name,
            config.policy,
            answer.retries,
            {k: round(v, 4) for k, v in decision.estimates.items()},
        )
        return StreamingResponse(
            answer.body(),
            answer.status,
            headers=answer.headers,
            background=BackgroundTask(answer.close),
        )

    async def models(self, request: Request) -> Response:
        """Any replica's model list (they serve one model)."""
        refused = _refusal(request, self.config)
        if refused is not None:
            return refused
        assert self.session is not None, "the lifespan opens the session"
        for replica in self.replicas.up():
            try:
                async with self.session.get(
                    replica.url + "/v1/models", headers=self.headers
                ) as resp:
                    return Response(await resp.read(), resp.status, media_type="application/json")
            except aiohttp.ClientError as exc:
                self.replicas.mark_failed(replica, f"{type(exc).__name__}: {exc}")
        return _error(503, "no replica is up", "server_error")


def create_app(
    config: RouterConfig,
    decide: Decide,
    prompt: PromptTokens | None = None,
    index: PrefixIndex | None = None,
) -> FastAPI:
    """The router app; its lifespan polls the replicas, holds the client session and, with an
    ``index`` (the one ``decide`` reads), feeds it the replicas' KV events."""
    router = Router(config, decide, prompt)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(sock_connect=5, sock_read=config.request_timeout_s)
        router.session = aiohttp.ClientSession(timeout=timeout)
        await router.replicas.start()
        feed, reconciler = _follow_events(router, index) if index is not None else (None, None)
        app.state.feed, app.state.reconciler = feed, reconciler
        try:
            yield
        finally:
            if reconciler is not None:
                await reconciler.close()
            if feed is not None:
                feed.close()
            await router.replicas.close()
            await router.session.close()

    app = FastAPI(title="cachetier router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        up = len(router.replicas.up())
        return JSONResponse({"replicas_up": up}, 200 if up else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/fleet/index")
    async def fleet_index(request: Request) -> JSONResponse:
        """What the index holds of each replica: epoch and, per medium, count and digest."""
        refused = _index_refusal(request, config, index)
        if refused is not None:
            return refused
        assert index is not None, "refused above"
        return JSONResponse({"replicas": describe_index(index)})

    @app.post("/v1/fleet/lookup")
    async def fleet_lookup(request: Request) -> Response:
        """Where a prompt's blocks are held, per replica (``cachetier.router.lookup``)."""
        refused = _index_refusal(request, config, index)
        if refused is not None:
            return refused
        assert index is not None, "refused above"
        parsed = _json_object(await _body(request, config.max_body_bytes), config.max_body_bytes)
        if isinstance(parsed, Response):
            return parsed
        path = ROUTED_PATHS[1] if "messages" in parsed else ROUTED_PATHS[0]
        tokens = router.tokens.of(path, parsed)
        if not tokens:
            return _error(
                400,
                "no prompt token ids: send 'prompt' as token ids, or text or 'messages' to a "
                "router started with --model",
            )
        return JSONResponse(lookup_answer(index, router.replicas.replicas, tokens))

    for path in ROUTED_PATHS:
        app.add_api_route(path, router.route, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    return app


def describe_index(index: PrefixIndex) -> dict[str, dict[str, object]]:
    """Per replica: the epoch its blocks are held under and each medium's count and digest."""
    out: dict[str, dict[str, object]] = {}
    for name in index.replicas:
        media = {
            medium: {"count": count, "xor": f"{acc:016x}"}
            for medium, (count, acc) in index.digests(name).items()
        }
        out[name] = {"epoch": index.epoch(name), "media": media}
    return out


def _refusal(request: Request, config: RouterConfig) -> Response | None:
    if config.api_key is None:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), config.api_key.encode()
    ):
        return None
    return _error(401, "a valid API key is needed: send 'Authorization: Bearer <key>'")


async def _body(request: Request, limit: int) -> bytes | None:
    """The body, or ``None`` once it passes ``limit`` (read no further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _follow_events(router: Router, index: PrefixIndex) -> tuple[EventFeed, Reconciler]:
    """Start feeding ``index`` the replicas' (and a sidecar's) KV events, and reconciling it."""
    config = router.config
    shared = None
    if config.shared_events is not None:
        shared = (config.shared_events, config.shared_events_replay)
    feed = EventFeed(router.replicas, index, shared, config.events_of())
    feed.start()
    reconciler = Reconciler(router.replicas, index, config.reconcile_interval_s)
    reconciler.start()
    router.metrics.watch_index(feed, reconciler)
    return feed, reconciler


def _index_refusal(
    request: Request, config: RouterConfig, index: PrefixIndex | None
) -> Response | None:
    """The answer to a request for the index it may not have, or ``None`` to go on."""
    refused = _refusal(request, config)
    if refused is None and index is None:
        return _error(404, "this router keeps no prefix index (its policy reads none)")
    return refused


def _json_object(body: bytes | None, limit: int) -> dict | Response:
    """The body as a JSON object, or the error to answer."""
    if body is None:
        return _error(413, f"the body is over {limit} bytes")
    try:
        parsed = json.loads(body)
    except ValueError:
        return _error(400, "the body is not JSON")
    if not isinstance(parsed, dict):
        return _error(400, "the body is not a JSON object")
    return parsed


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
