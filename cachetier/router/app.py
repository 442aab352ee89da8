"""The router's HTTP app: an OpenAI-compatible proxy in front of N engine replicas.

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not) are tokenized
(``prompt``), given to the policy (``decide``: ``cachetier.router.decide``), which orders the
replicas that are up, and forwarded to the first that answers (``proxy``). ``GET /v1/models``
goes to any replica that is up; ``/healthz`` is 200 while one is; ``/metrics`` counts every
decision, retry and refusal. Each decision is logged with its estimates (logger
``cachetier.router``, at debug).

Parsing, tokenizing and the policy's weighing run on the router's ``PrepareQueue`` threads, so
no request holds the event loop: ``/healthz`` and the answers streaming back keep flowing
whatever is being tokenized. A body past ``max_body_bytes`` gets 413, bad input 400, and a
request the queue has no room or time for 503 with ``Retry-After``.
"""

from __future__ import annotations

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
from cachetier.router.http import busy, error, read_body, tenant_or_refusal
from cachetier.router.lookup import add_fleet_routes
from cachetier.router.prompt import BadPromptError, PromptTokens, parse_body
from cachetier.router.proxy import NoReplicaError, forward
from cachetier.router.reconcile import Reconciler
from cachetier.router.replicas import Replica, ReplicaSet
from cachetier.router.work import PrepareBusyError, PrepareQueue

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
        self.replicas = ReplicaSet(config.replicas, config.key_of(), config.poll_interval_s)
        self.metrics = RouterMetrics(self.replicas, config.policy)
        self.tokens = prompt if prompt is not None else PromptTokens(config.model)
        self.prepare = PrepareQueue(
            config.num_prepare_threads, config.max_queued_prepares, config.prepare_timeout_s
        )
        # No key here: the session's middleware sends each replica its own.
        self.headers = {"Content-Type": "application/json"}
        self.session: aiohttp.ClientSession | None = None

    def body_limit(self) -> int:
        """``max_body_bytes``, or the smallest limit a replica up reports if that is lower: a
        body no replica would take is refused before any work is spent on it."""
        reported = [r.state.get("max_request_bytes") for r in self.replicas.up()]
        limits = [n for n in reported if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        return min([self.config.max_body_bytes, *limits])

    def open_session(self) -> None:
        timeout = aiohttp.ClientTimeout(sock_connect=5, sock_read=self.config.request_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, middlewares=(self.replicas.auth,))

    async def prepared(
        self, path: str, body: bytes, session_id: str | None
    ) -> tuple[dict, RouteDecision] | Response:
        """The body parsed and the policy's decision, worked out on a prepare thread; or the
        answer to give instead (400 for bad input, 503 when the router has no room)."""
        up = self.replicas.up()

        def work() -> tuple[dict, RouteDecision]:
            parsed = parse_body(body)
            session = session_id or _str(parsed.get("user"))
            return parsed, self.decide(self.tokens.of(path, parsed), session, up)

        try:
            return await self.prepare.run(work)
        except BadPromptError as exc:
            return error(400, str(exc))
        except PrepareBusyError as exc:
            return busy(str(exc))

    async def route(self, request: Request) -> Response:
        """Tokenize, decide, forward; the answer streams back as the replica sends it."""
        config, metrics = self.config, self.metrics
        tenant = tenant_or_refusal(request, config)
        if isinstance(tenant, Response):
            return tenant
        body = await read_body(request, self.body_limit())
        if isinstance(body, Response):
            return body
        path = request.url.path
        prepared = await self.prepared(path, body, request.headers.get("x-session-id"))
        if isinstance(prepared, Response):
            return prepared
        _, decision = prepared
        assert self.session is not None, "the lifespan opens the session"
        try:
            answer = await forward(
                self.session, self.replicas, decision.order, path, body, self.headers
            )
            answer.take_work(decision.work_s.get(answer.replica.name, 0.0))
        except NoReplicaError as exc:
            metrics.unrouted.inc()
            return error(503, str(exc), "server_error")
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
        refused = tenant_or_refusal(request, self.config)
        if isinstance(refused, Response):
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
        return error(503, "no replica is up", "server_error")


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
        router.open_session()
        assert router.session is not None, "just opened"
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
            router.prepare.close()

    app = FastAPI(title="cachetier router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        up = len(router.replicas.up())
        return JSONResponse({"replicas_up": up}, 200 if up else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_fleet_routes(app, config, router.replicas, router.tokens, router.prepare, index)
    for path in ROUTED_PATHS:
        app.add_api_route(path, router.route, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    return app


def _follow_events(router: Router, index: PrefixIndex) -> tuple[EventFeed, Reconciler]:
    """Start feeding ``index`` the replicas' (and a sidecar's) KV events, and reconciling it."""
    config = router.config
    shared = None
    if config.shared_events is not None:
        shared = (config.shared_events, config.shared_events_replay)
    curve = None
    if config.events_curve_key is not None and config.events_curve_server_key is not None:
        curve = (config.events_curve_key, config.events_curve_server_key)
    feed = EventFeed(router.replicas, index, shared, config.events_of(), curve)
    feed.start()
    reconciler = Reconciler(router.replicas, index, config.reconcile_interval_s)
    reconciler.start()
    router.metrics.watch_index(feed, reconciler)
    return feed, reconciler


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
