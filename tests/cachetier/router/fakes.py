"""Hostile and recording replicas for the router's trust tests: real HTTP servers (uvicorn in a
thread, port 0) that answer what a replica answers, report what the test tells them to in
``/v1/fleet/state``, and write down every ``Authorization`` header they are sent."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse

from cachetier.primitives.keys import KVLayout
from tests.support import AppThread

LAYOUT = KVLayout("float16", block_size=4, num_layers=1, num_kv_heads=1, head_dim=4)
ANSWER = {"id": "cmpl-fake", "object": "text_completion", "choices": [{"text": "ok"}]}


@dataclass
class FakeReplica:
    """What a fake replica reports and where it sends completions; ``seen`` is every
    ``Authorization`` header it was sent (``""`` for none)."""

    tenant: str = ""
    kv_events: dict[str, Any] | None = None
    redirect_to: str | None = None
    max_request_bytes: int | None = None
    seen: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # of every request, in order
    server: AppThread | None = None

    def state(self) -> dict[str, Any]:
        namespace = {"model_fingerprint": "fake-model", "layout": asdict(LAYOUT)}
        return {
            "object": "fleet.state",
            "num_running": 0,
            "num_waiting": 0,
            "namespace": {**namespace, "tenant": self.tenant},
            "kv_events": self.kv_events,
            "max_request_bytes": self.max_request_bytes,
        }

    @property
    def url(self) -> str:
        assert self.server is not None, "start() first"
        return self.server.url

    def start(self) -> FakeReplica:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            self.seen.append(request.headers.get("authorization", ""))
            self.paths.append(request.url.path)
            return await call_next(request)

        app.get("/healthz")(lambda: {"status": "ok"})
        app.get("/v1/fleet/state")(lambda: self.state())

        @app.post("/v1/completions")
        async def complete() -> Any:
            if self.redirect_to is not None:  # 307: the client repeats the POST there
                return RedirectResponse(self.redirect_to + "/v1/completions", 307)
            return JSONResponse(ANSWER)

        self.server = AppThread(lambda: app, name="fake replica")
        self.server.start_thread()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
