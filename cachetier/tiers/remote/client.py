"""The HTTP calls of the remote tier: one pooled aiohttp session to one cachetier server.

Each method is one request; it returns what the server answered or raises:
``TierUnavailableError`` / aiohttp and OS errors when the server is down, slow or answers
garbage (worth a retry), ``ServerBusyError`` on a 429 or 503 with ``Retry-After`` (back off),
``RequestRefusedError`` on another 4xx (it is not).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from typing import Any

import aiohttp

from cachetier.errors import RequestRefusedError, TierUnavailableError
from cachetier.primitives.keys import BlockHash
from cachetier.protocol.http_batch import (
    BATCH_MEDIA_TYPE,
    BatchReader,
    FrameError,
    batch_parts,
)
from cachetier.protocol.transfer_frames import TransferAddress
from cachetier.record import Buffer
from cachetier.tiers.remote.busy import ServerBusyError, retry_after_s, wait_in
from cachetier.tiers.remote.config import RemoteTierConfig

_JSON = {"Content-Type": "application/json"}
_READ_BUFFER_BYTES = 1 << 20  # aiohttp's 64 KiB default pauses the socket far too often here


class _PartsPayload(aiohttp.payload.Payload):
    """A request body sent as a list of buffers under a known length (no join, no chunking)."""

    def __init__(self, parts: list[Buffer], size: int) -> None:
        super().__init__(parts, content_type=BATCH_MEDIA_TYPE)
        self._parts = parts
        self._size = size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a batch body is binary")

    async def write(self, writer: Any) -> None:
        for part in self._parts:
            await writer.write(memoryview(part).cast("B"))

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        await self.write(writer)


class RemoteClient:
    """Requests to one server. Must be used from one event loop (the one that opens it).

    Args:
        config: where the server is, the token, timeouts and pool size.
        tls: client context for an ``https://`` url (``cachetier.util.tls.client_context``), else
            ``None``.
    """

    def __init__(self, config: RemoteTierConfig, tls: ssl.SSLContext | None = None) -> None:
        if config.tls != (tls is not None):
            raise ValueError("an https:// url needs a TLS context, and only one does")
        self._config = config
        self._tls = tls
        self._base = config.base_url + "/v1/namespaces/"
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {}
            if self._config.token:
                headers["Authorization"] = f"Bearer {self._config.token}"
            if self._config.tenant:
                headers["X-Cachetier-Tenant"] = self._config.tenant
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._config.max_connections,
                    # Our context for https (its CA bundle, verification on); True: aiohttp's
                    # default for an http url, where it is not used.
                    ssl=self._tls if self._tls is not None else True,
                    # Below the server's keep-alive (75 s from `cachetier serve`).
                    keepalive_timeout=30,
                ),
                timeout=aiohttp.ClientTimeout(
                    total=self._config.timeout_s, connect=self._config.connect_timeout_s
                ),
                headers=headers,
                auto_decompress=False,
                read_bufsize=_READ_BUFFER_BYTES,
                raise_for_status=False,
            )
        return self._session

    async def limits(self) -> dict[str, Any]:
        """The server's request limits (``LimitsPublic``): its four sizes, and where it takes
        block transfers (``transfer``: a ``TransferAddress``, or ``None``)."""
        async with self._open().get(self._config.base_url + "/v1/limits") as resp:
            answer = await _json(resp)
        names = ("max_block_bytes", "max_batch_bytes", "max_batch_blocks", "max_keys")
        out: dict[str, Any] = {name: int(answer[name]) for name in names}
        out["transfer"] = _transfer_address(answer)
        return out

    async def put(self, namespace: str, records: list[list[Buffer]]) -> int:
        """Store records in one batch request.

        Args:
            namespace: the client's namespace.
            records: per record its parts (``encode_parts``).

        Returns:
            How many the server stored.
        """
        parts, total = batch_parts(records)
        url = f"{self._base}{namespace}/batch/put"
        async with self._open().post(url, data=_PartsPayload(parts, total)) as resp:
            answer = await _json(resp)
        return int(answer["num_stored"])

    async def get(self, namespace: str, keys: Sequence[BlockHash]) -> list[memoryview | None]:
        """Fetch records, unchecked, in one batch request.

        Args:
            namespace: the client's namespace.
            keys: the keys to fetch.

        Returns:
            Records of the leading keys, ``None`` where the server missed; fewer than
            ``keys`` when the server's byte limit cut its answer short.
        """
        url = f"{self._base}{namespace}/batch/get"
        reader = BatchReader(
            max_records=len(keys),
            max_record_bytes=self._config.max_record_bytes,
            max_batch_bytes=len(keys) * (self._config.max_record_bytes + 8) + 8,
        )
        async with self._open().post(url, data=_keys_body(keys), headers=_JSON) as resp:
            await _check(resp)
            if resp.content_type != BATCH_MEDIA_TYPE:
                raise TierUnavailableError(f"server answered a get with {resp.content_type}")
            try:
                async for chunk in resp.content.iter_any():
                    reader.feed(chunk)
                records = reader.finish()
            except FrameError as exc:
                raise TierUnavailableError(f"server sent a bad batch: {exc}") from None
        if not 0 < len(records) <= len(keys) and keys:
            raise TierUnavailableError(f"server sent {len(records)} records for {len(keys)} keys")
        return records

    async def lookup(self, namespace: str, keys: Sequence[BlockHash]) -> dict[str, Any]:
        """Ask which leading keys the server stores.

        Args:
            namespace: the client's namespace.
            keys: block keys in sequence order.

        Returns:
            The server's ``LookupPublic`` answer.
        """
        return await self._post_keys(namespace, "lookup", keys)

    async def present(self, namespace: str, keys: Sequence[BlockHash]) -> list[bool]:
        """Ask whether the server stores each key.

        Args:
            namespace: the client's namespace.
            keys: the keys asked about.

        Returns:
            One flag per key.
        """
        return list((await self._post_keys(namespace, "batch/exists", keys))["present"])

    async def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """Remove blocks.

        Args:
            namespace: the client's namespace.
            keys: the keys to remove.

        Returns:
            How many were present.
        """
        return int((await self._post_keys(namespace, "batch/delete", keys))["num_deleted"])

    async def clear(self, namespace: str) -> int:
        """Remove every block of a namespace (this tenant's only).

        Args:
            namespace: the client's namespace.

        Returns:
            How many were removed.
        """
        async with self._open().delete(f"{self._base}{namespace}") as resp:
            return int((await _json(resp))["num_deleted"])

    async def report_quarantine(self, namespace: str, reason: str, writer: str = "") -> int:
        """Tell the server that ``namespace`` served KV that does not match a recomputation,
        so it stops serving it (``writer``'s records of it, if given) to every client.

        Args:
            namespace: the client's namespace.
            reason: what differed (cut to the server's 500 characters).
            writer: the writer whose records differed (``writer_name``); empty for all.

        Returns:
            How many quarantines the server holds for it.
        """
        url = self._config.base_url + "/v1/quarantines"
        fields = {"namespace": namespace, "reason": reason[:500]}
        if writer:
            fields["writer"] = writer
        body = json.dumps(fields).encode()
        async with self._open().post(url, data=body, headers=_JSON) as resp:
            return len((await _json(resp))["quarantines"])

    async def _post_keys(
        self, namespace: str, what: str, keys: Sequence[BlockHash]
    ) -> dict[str, Any]:
        url = f"{self._base}{namespace}/{what}"
        async with self._open().post(url, data=_keys_body(keys), headers=_JSON) as resp:
            return await _json(resp)

    async def close(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _transfer_address(answer: dict[str, Any]) -> TransferAddress | None:
    port, path, server_id = (
        answer.get(k) for k in ("transfer_port", "transfer_socket", "transfer_id")
    )
    if port is None and path is None:
        return None
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise TierUnavailableError(f"server named transfer port {port!r}")
    if path is not None and not isinstance(path, str):
        raise TierUnavailableError(f"server named transfer socket {path!r}")
    if isinstance(server_id, bool) or not isinstance(server_id, int):
        raise TierUnavailableError(f"server named transfer id {server_id!r}")
    tls = answer.get("transfer_tls", False)  # absent: a server from before TLS, plain TCP
    if not isinstance(tls, bool):
        raise TierUnavailableError(f"server named transfer_tls {tls!r}")
    return TransferAddress(port, path, server_id, tls=tls)


def _keys_body(keys: Sequence[BlockHash]) -> bytes:
    return json.dumps({"keys": [key.hex() for key in keys]}).encode()


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 400:
        return
    try:
        message = (await resp.json(content_type=None))["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        message = resp.reason or ""
    what = f"server answered {resp.status}: {message}"
    if resp.status in (429, 503) and "Retry-After" in resp.headers:
        # Up and busy: the exact wait its message ends with, else the header's whole seconds.
        wait_s = wait_in(str(message)) or retry_after_s(resp.headers["Retry-After"])
        raise ServerBusyError(what, wait_s)
    if resp.status >= 500 or resp.status == 429:
        raise TierUnavailableError(what)
    raise RequestRefusedError(what)


async def _json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    await _check(resp)
    try:
        answer = await resp.json(content_type=None)
    except ValueError as exc:
        raise TierUnavailableError(f"server sent bad JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise TierUnavailableError("server sent JSON that is not an object")
    return answer
