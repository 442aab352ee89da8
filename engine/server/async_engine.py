"""``AsyncEngine``: one thread owns the ``LLMEngine`` and steps it; asyncio handlers submit requests
and read their outputs.

The engine is not thread-safe, so only its thread touches it: handlers put requests and aborts on
a queue under a condition and get outputs back through their own ``asyncio.Queue`` (fed with
``call_soon_threadsafe``). With nothing to do the thread waits on the condition rather than
spinning; a step runs every request in flight (continuous batching).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from cachetier.engine.llm_engine import LLMEngine, RequestOutput
from cachetier.engine.sampling import SamplingParams
from cachetier.errors import CacheTierError

log = logging.getLogger(__name__)


class EngineDeadError(CacheTierError):
    """The engine thread has stopped (the server is shutting down, or a step failed)."""


class StepObserver(Protocol):
    """Told about every output, on the engine thread (e.g. to update metrics)."""

    def on_output(
        self, output: RequestOutput, arrival_s: float, previous_token_s: float | None, now: float
    ) -> None: ...


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the client's loop is closed: nobody is left to read it


@dataclass(slots=True)
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    arrival_s: float = field(default_factory=time.perf_counter)
    last_token_s: float | None = None


class AsyncEngine:
    """Runs ``engine`` on a thread of its own.

    Args:
        engine: the engine (owned by the caller, touched only by this object's thread).
        observer: told about every output, on the engine thread (settable until ``start()``).
    """

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._cond = threading.Condition()
        self._submits: list[_Submit] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Submit] = {}  # engine thread only
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def stats(self) -> dict[str, Any]:
        """The engine's ``stats()`` as of its last step (a snapshot; safe from any thread)."""
        return self._stats

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its outputs until the finished one.

        Leaving early (a client that went away, a stop string) aborts the request.

        Raises:
            ValueError: the engine refused the request (its message says why).
            EngineDeadError: the engine thread is not running.
        """
        stream = _Stream(asyncio.get_running_loop())
        with self._cond:
            if self._stopping or self._dead is not None:
                raise EngineDeadError("the engine is not running")
            self._submits.append(_Submit(request_id, list(prompt_token_ids), params, stream))
            self._cond.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (does nothing if it already finished)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the thread after its current step; requests still in flight fail. Blocking."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), "the engine thread did not stop"

    def _run(self) -> None:
        try:
            while self._take_work():
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                now = time.perf_counter()  # after the step: its tokens exist from now on
                # Before the outputs go out: a client told its request finished, who asks at
                # once (a router polling /v1/fleet/state), must not see it still running.
                self._stats = self.engine.stats()
                for out in outputs:
                    self._deliver(out, now)
        except BaseException as exc:
            # The engine's state is unknown after a failed step: stop, fail every request.
            log.exception("engine step failed; the engine is stopped")
            self._dead = exc
        else:
            # A clean stop: aborting saves the full blocks of requests cut short to the tiers.
            for request_id in self._live:
                self.engine.abort_request(request_id)
        error = EngineDeadError("the engine stopped before the request finished")
        if self._dead is not None:
            error.__cause__ = self._dead
        with self._cond:
            pending, self._submits = self._submits, []
        for sub in [*pending, *self._live.values()]:
            sub.stream.put(error)
        self._live.clear()

    def _take_work(self) -> bool:
        """Wait for work; admit new requests and apply aborts. False once told to stop."""
        with self._cond:
            while not (self._stopping or self._submits or self._aborts or self._live):
                self._cond.wait()
            if self._stopping:
                return False
            submits, self._submits = self._submits, []
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            if self._live.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
        for sub in submits:
            if sub.request_id in aborts:
                continue
            try:
                self.engine.add_request(sub.prompt_token_ids, sub.params, sub.request_id)
            except ValueError as exc:
                sub.stream.put(exc)
                continue
            self._live[sub.request_id] = sub
        return True

    def _deliver(self, out: RequestOutput, now: float) -> None:
        sub = self._live.get(out.request_id)
        if sub is None:
            return
        if self.observer is not None:
            self.observer.on_output(out, sub.arrival_s, sub.last_token_s, now)
        sub.last_token_s = now
        if out.finished:
            del self._live[out.request_id]
        sub.stream.put(out)
