"""Who may call the router, as which tenant, and which key each replica is sent.

Clients: the router's ``api_key`` is tenant ``""`` (the engine's default tenant); a keys file
adds keys of named tenants. A caller's tenant decides what ``/v1/fleet/lookup`` tells it.

Replicas: each replica is sent only its own key (``RouterConfig.replica_api_keys``), by a
middleware of the router's client sessions that sets ``Authorization`` from the URL a request
goes to: a request to anything but a replica (a redirect elsewhere) carries no key. The single
``replica_api_key`` is the fallback for replicas with no key of their own.

The keys file is JSON: ``{"clients": {"<key>": "<tenant>", ...}, "replicas": {"r0": "<key>",
...}}`` (replicas named as the router names them: ``r0`` for the first ``--replica``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from yarl import URL


def load_keys_file(path: str | Path) -> tuple[tuple[tuple[str, str], ...], dict[str, str]]:
    """The client keys (key, tenant) and the replicas' keys (name -> key) of a keys file.

    Raises:
        ValueError: the file is not a JSON object of that shape.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"keys file {path}: {type(exc).__name__}") from None
    if not isinstance(raw, dict) or set(raw) - {"clients", "replicas"}:
        raise ValueError(f"keys file {path} must be an object of 'clients' and 'replicas'")
    clients, replicas = raw.get("clients", {}), raw.get("replicas", {})
    for what, table in (("clients", clients), ("replicas", replicas)):
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k for k, v in table.items()
        ):
            raise ValueError(f"keys file {path}: '{what}' must map strings to strings")
    return tuple(clients.items()), dict(replicas)


def caller_tenant(
    authorization: str, api_key: str | None, client_keys: Sequence[tuple[str, str]]
) -> str | None:
    """The tenant of the key in an ``Authorization`` header, or ``None`` for no valid key.

    Args:
        authorization: the header's value (``""`` when absent).
        api_key: the router's own key (tenant ``""``); with it and ``client_keys`` both
            empty, every caller is tenant ``""``.
        client_keys: (key, tenant) pairs.
    """
    if api_key is None and not client_keys:
        return ""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    sent = token.strip().encode()
    found = None
    # Every key is compared, so the time taken says nothing of which one matched.
    for key, tenant in ((api_key, ""), *client_keys):
        if key is not None and hmac.compare_digest(sent, key.encode()) and found is None:
            found = tenant
    return found


def replica_auth(keys: dict[str, str]) -> aiohttp.ClientMiddlewareType:
    """A client middleware that sends each replica its own key.

    Args:
        keys: replica base URL (``http://host:port``, no trailing slash) -> its key.
    """
    # As yarl spells a request's URL (host lower-cased, a default port dropped); longest
    # first, so that a replica under another's path prefix gets its own key.
    spelled = {str(URL(base)).rstrip("/"): key for base, key in keys.items()}
    ordered = sorted(spelled.items(), key=lambda item: -len(item[0]))

    async def middleware(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        url = str(request.url)
        request.headers.popall("Authorization", None)
        for base, key in ordered:
            if url == base or url.startswith(base + "/") or url.startswith(base + "?"):
                request.headers["Authorization"] = f"Bearer {key}"
                break
        return await handler(request)

    return middleware
