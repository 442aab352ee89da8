"""``SlowLink``: a real TCP hop with a bandwidth cap and a one-way latency, for tests and
benchmarks that need a slow but healthy tier (Redis or the sidecar over a thin link).

Clients connect to the link's port; each connection opens one to the target and bytes flow
both ways through an asyncio loop on a thread of its own. Each direction behaves like one
physical link shared by every connection: a chunk of ``n`` bytes occupies it for
``n / bandwidth`` seconds after the previous chunk, and arrives ``latency`` seconds after it
left, so a pipelined stream pays the latency once, not once per chunk. Nothing is mocked:
the client's and the server's sockets are real, only the pace between them is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

_CHUNK = 64 << 10  # smooth pacing: a chunk is the unit the link schedules
_QUEUE_CHUNKS = 32  # per direction of a connection: bounded memory, backpressure on readers


class _Wire:
    """One direction of the link: when it is next free, shared by all of its connections."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def send(self, nbytes: int, bandwidth: float | None, latency: float) -> float:
        """Schedule ``nbytes`` now; returns when they arrive (``time.monotonic`` seconds)."""
        now = time.monotonic()
        start = max(now, self.free_at)
        self.free_at = start + (nbytes / bandwidth if bandwidth else 0.0)
        return self.free_at + latency


class SlowLink:
    """A throttled TCP proxy to ``target``, running while the ``with`` block runs.

    Args:
        target: ``(host, port)`` to forward to.
        bandwidth_bytes_per_s: cap per direction; ``None`` or 0 for none.
        latency_s: one-way delay added to every byte.
    """

    def __init__(
        self,
        target: tuple[str, int],
        bandwidth_bytes_per_s: float | None = None,
        latency_s: float = 0.0,
    ) -> None:
        self.target = target
        self.host = "127.0.0.1"
        self.port = 0
        self.bytes_forwarded = 0
        self.set(bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s)
        self._wires = {"up": _Wire(), "down": _Wire()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def set(self, *, bandwidth_bytes_per_s: float | None, latency_s: float) -> None:
        """Change the link's pace; chunks sent from now on get it."""
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s < 0:
            raise ValueError(f"bandwidth must be >= 0, got {bandwidth_bytes_per_s}")
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        self.bandwidth = bandwidth_bytes_per_s or None
        self.latency = latency_s

    def url(self, scheme: str) -> str:
        """``redis://host:port/0`` or ``http://host:port`` through the link."""
        if scheme == "redis":
            return f"redis://{self.host}:{self.port}/0"
        return f"{scheme}://{self.host}:{self.port}"

    def __enter__(self) -> SlowLink:
        ready = threading.Event()
        loop = asyncio.new_event_loop()
        self._loop = loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(asyncio.start_server(self._accept, self.host, 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="slow-link", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the slow link did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        stopped = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        with contextlib.suppress(Exception):
            stopped.result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # no goodbye to a peer that never closes
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            self._writers.add(up_writer)
            # Each direction ends at its own EOF (a half-close is passed on); an error in
            # either ends both.
            await asyncio.gather(
                self._pipe(reader, up_writer, self._wires["up"]),
                self._pipe(up_reader, writer, self._wires["down"]),
            )
        except (OSError, ConnectionError, asyncio.CancelledError):
            pass  # a reset, a refused target, or the link shutting down: close both ends
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.transport.abort()
                    self._writers.discard(w)
            if task is not None:
                self._tasks.discard(task)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, wire: _Wire
    ) -> None:
        # The reader stamps each chunk with its arrival time and goes on reading (up to a
        # bounded queue) while the writer waits for each stamp: chunks in flight overlap their
        # latency, as on a real link.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)

        async def read() -> None:
            while True:
                data = await src.read(_CHUNK)
                await queue.put((wire.send(len(data), self.bandwidth, self.latency), data))
                if not data:
                    return

        reading = asyncio.get_running_loop().create_task(read())
        getting: asyncio.Future[tuple[float, bytes]] | None = None
        try:
            while True:
                getting = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getting, reading}, return_when="FIRST_COMPLETED")
                if getting not in done:
                    getting.cancel()
                    reading.result()  # the reader failed: raise its error
                    continue
                arrive, data = getting.result()
                delay = arrive - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                self.bytes_forwarded += len(data)
                await dst.drain()
        finally:
            for pending in (reading, getting):
                if pending is not None and not pending.done():
                    pending.cancel()
                    with contextlib.suppress(BaseException):
                        await pending
