"""One JSON request to a running sidecar, from the command line's tools (``cachetier pin`` and
friends, ``cachetier report --stats http://...``): stdlib ``urllib`` only, so these work where
neither aiohttp nor the server's packages are installed, with the bearer token from the
environment, sent and never printed.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

TOKEN_ENV = "CACHETIER_REMOTE_TOKEN"
"""The bearer token's variable (the one ``StoreConfig.from_env`` reads for the remote tier)."""


def call_sidecar(
    url: str, method: str, body: Any = None, *, timeout_s: float = 30.0
) -> tuple[int, Any]:
    """Send one request and read its JSON answer.

    Args:
        url: the whole URL (``http(s)://host:port/path?query``).
        method: the HTTP method.
        body: a JSON-able request body, or ``None`` for none.
        timeout_s: seconds to wait for the server.

    Returns:
        ``(status, answer)``: the HTTP status and its parsed JSON (its raw text or reason when
        it is not JSON); ``(0, reason)`` when the server cannot be reached.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Accept", "application/json")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    token = os.environ.get(TOKEN_ENV)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, _json_or_text(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json_or_text(exc.read()) or exc.reason
    except (urllib.error.URLError, OSError) as exc:
        return 0, getattr(exc, "reason", exc)


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")
