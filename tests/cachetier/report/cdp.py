"""A real headless Chromium, driven over the DevTools protocol with aiohttp's websocket client.

Shared by the report's browser test and ``benchmarks/ops/report.py``. Chromium is Debian's
``chromium`` package; it runs with ``--no-sandbox`` because CI runs as root, where Chromium
refuses its sandbox. ``--remote-debugging-port=0`` lets it pick a free port, which it writes to
``DevToolsActivePort`` in the profile folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

CHROMIUM_ENV = "CACHETIER_CHROMIUM"
"""Names another Chromium binary; by default ``chromium`` on ``PATH``."""


class BrowserMissingError(RuntimeError):
    """No Chromium to run: the message says which Debian package to install."""


def find_chromium() -> str:
    """The Chromium binary: ``$CACHETIER_CHROMIUM``, else ``chromium`` on ``PATH``.

    Raises:
        BrowserMissingError: neither is there.
    """
    named = os.environ.get(CHROMIUM_ENV)
    found = named if named and os.access(named, os.X_OK) else shutil.which("chromium")
    if not found:
        raise BrowserMissingError(
            "no Chromium: install Debian's `chromium` package (apt-get install chromium), "
            f"or set ${CHROMIUM_ENV} to a Chromium binary"
        )
    return found


class Browser:
    """One headless Chromium process and one page tab, attached over a flat CDP session.

    Use ``async with Browser(...) as page:``; events of the page are kept in ``events`` in
    arrival order as ``(method, params)``.

    Args:
        width: the viewport's CSS width.
        height: the viewport's CSS height.
        start_timeout_s: how long Chromium may take to open its DevTools port.
    """

    def __init__(self, width: int = 1100, height: int = 900, start_timeout_s: float = 60) -> None:
        self.width, self.height = width, height
        self.start_timeout_s = start_timeout_s
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiters: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._session_id = ""
        self._dismissals: set[asyncio.Future[dict[str, Any]]] = set()

    async def __aenter__(self) -> Browser:
        binary = find_chromium()
        self._profile = tempfile.TemporaryDirectory(prefix="cachetier-chromium-")
        profile = Path(self._profile.name)
        self._proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # root in CI: Chromium will not start its sandbox as root
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(profile / "chromium.log", "wb"),  # noqa: SIM115  (closed with the process)
            # Its own process group: the renderer, GPU and zygote processes are stopped with
            # it, so none is still writing into the profile when the profile is removed.
            start_new_session=True,
        )
        try:
            await self._connect(profile)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _connect(self, profile: Path) -> None:
        assert self._proc is not None, "started in __aenter__"
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.start_timeout_s
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if self._proc.poll() is not None:
                log = (profile / "chromium.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"chromium exited with {self._proc.returncode}:\n{log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium opened no DevTools port in {self.start_timeout_s} s")
            await asyncio.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        self._http = aiohttp.ClientSession()
        # Screenshots come back as one base64 message of several MB.
        self._ws = await self._http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        target = await self.send("Target.createTarget", {"url": "about:blank"}, browser=True)
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, browser=True
        )
        self._session_id = attached["sessionId"]

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ws is not None:
            if self._reader is not None:
                # A clean exit lets Chromium flush the profile before its processes go.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.send("Browser.close", {}, browser=True), 5)
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)  # whatever of the group is left
        if self._profile is not None:
            _remove_profile(Path(self._profile.name))
            self._profile.cleanup()  # gone already: only detaches its finaliser

    async def _read(self) -> None:
        assert self._ws is not None, "connected"
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    if "error" in data:
                        future.set_exception(RuntimeError(f"CDP error: {data['error']}"))
                    else:
                        future.set_result(data.get("result", {}))
                continue
            method, params = data.get("method", ""), data.get("params", {})
            self.events.append((method, params))
            if method == "Page.javascriptDialogOpening":
                # An open alert() blocks the page (and every later evaluate): dismiss it; the
                # event stays in ``events`` for the caller to count.
                self._dismissals.add(
                    asyncio.ensure_future(
                        self.send("Page.handleJavaScriptDialog", {"accept": False})
                    )
                )
            for name, waiter in list(self._waiters):
                if name == method and not waiter.done():
                    waiter.set_result(params)
                    self._waiters.remove((name, waiter))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("chromium closed the DevTools socket"))

    async def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        browser: bool = False,
        timeout_s: float = 60,
    ) -> dict[str, Any]:
        """Send one command (to the page, or with ``browser`` to the browser) and await its result.

        Raises:
            RuntimeError: Chromium answered with an error.
        """
        assert self._ws is not None, "connected"
        message: dict[str, Any] = {"id": next(self._ids), "method": method, "params": params or {}}
        if not browser:
            message["sessionId"] = self._session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[message["id"]] = future
        await self._ws.send_str(json.dumps(message))
        return await asyncio.wait_for(future, timeout_s)

    def expect(self, method: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the next event ``method``: take it before the command that causes it."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters.append((method, future))
        return future

    async def evaluate(self, expression: str) -> Any:
        """Run JavaScript in the page (awaiting a promise it returns) and return its value.

        Raises:
            RuntimeError: the script threw.
        """
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def click(self, x: float, y: float) -> None:
        """A real left click at viewport coordinates (mouse moved there, pressed, released)."""
        await self.move_mouse(x, y)
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1},
            )

    async def move_mouse(self, x: float, y: float) -> None:
        """Move the real mouse pointer to viewport coordinates (fires mouseover/mousemove)."""
        await self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})


def _remove_profile(folder: Path) -> None:
    """Remove Chromium's profile folder; a process of the killed group may still be closing a
    file in it for a moment, so a failed removal is tried again before it is left to /tmp."""
    for _ in range(20):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return
        time.sleep(0.1)
