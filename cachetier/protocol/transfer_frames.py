"""The transfer port's framing: batch gets and puts of records over TCP or a Unix socket.

The HTTP API carries every operation; this second port carries only the two that move
megabytes, without HTTP's costs (uvicorn hands a body over in 256 KiB ``bytes`` chunks through
the event loop, and aiohttp copies each again). Both ends read records straight into their
destination with ``recv_into`` and checksum them chunk by chunk. Little-endian throughout::

    hello    client: "CTX1" | token_len u16 | tenant_len u16 | token | tenant
             server: reply head (value: the server's id, as /v1/limits gives it, so a client
               knows the port or socket it reached is the server it asked over HTTP)
    request  op u8 | namespace_len u8 | count u32 | namespace, then
               GET: count x key (32 B)
               PUT: count x length u64 | count records
    reply    status u8 | value u32, then
               OK to GET: value = records answered (<= count; fewer when the server's byte
                 budget ran out: ask again for the rest) | value x length u64 | records
                 (length 0 = miss)
               OK to PUT: value = records the server holds of the put (stored now or held
                 before) | count x present u8: per record in request order, 1 when its key
                 was held already (that record is kept, the one sent dropped), else 0
               not OK: value = message length | message (UTF-8)

A record is a ``cachetier.record`` record, checked on arrival (checksum, key, fingerprint);
the tenant comes from the hello's token, exactly as with HTTP. Records are immutable (a key
names its KV): a put of a held key keeps the first record, and the put reply's flags say so.
After an error reply to a malformed request the server closes the connection; after a refused
put (a bad record) the body has been read to its end and the connection stays usable.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from cachetier.errors import RequestRefusedError, TierUnavailableError

MAGIC = b"CTX1"
HELLO = struct.Struct("<4sHH")
REQUEST = struct.Struct("<BBI")
REPLY = struct.Struct("<BI")
LENGTH = struct.Struct("<Q")
KEY_BYTES = 32
MAX_TOKEN_BYTES = 1024
MAX_TENANT_BYTES = 64
MAX_MESSAGE_BYTES = 1024


class Op(IntEnum):
    """What a request asks for (its first byte)."""

    GET = 1
    PUT = 2


class Status(IntEnum):
    """How a reply answers (its first byte); all but ``OK`` carry a message."""

    OK = 0
    BAD_REQUEST = 1  # malformed request, bad namespace, or a record that fails its checks
    UNAUTHORIZED = 2
    FORBIDDEN = 3
    TOO_LARGE = 4
    BUSY = 5  # the server has all the connections it accepts
    FAILED = 6  # the server failed (its log says why)


@dataclass(frozen=True, slots=True)
class TransferAddress:
    """Where a server takes transfers (``/v1/limits`` publishes it).

    Args:
        port: its TCP port on the server's host, or ``None``.
        socket_path: its Unix socket, for clients on the same host (or sharing the folder),
            or ``None``.
        server_id: the id its hello replies carry (random per server start).
        tls: the TCP port speaks TLS (the Unix socket never does): a client must not send its
            token there in clear.
    """

    port: int | None
    socket_path: str | None
    server_id: int
    tls: bool = False


def hello(token: str | None, tenant: str | None) -> bytes:
    """The client's first message.

    Args:
        token: the bearer token, or ``None`` for a server in open mode.
        tenant: the tenant the client expects its token to act as, or ``None``.

    Returns:
        The hello's bytes.

    Raises:
        ValueError: the token or the tenant is longer than the protocol carries.
    """
    token_b = (token or "").encode()
    tenant_b = (tenant or "").encode()
    if len(token_b) > MAX_TOKEN_BYTES or len(tenant_b) > MAX_TENANT_BYTES:
        raise ValueError("token or tenant too long for the transfer protocol")
    return HELLO.pack(MAGIC, len(token_b), len(tenant_b)) + token_b + tenant_b


def request(op: Op, namespace: str, count: int) -> bytes:
    """A request head and its namespace (the body follows).

    Args:
        op: the operation.
        namespace: the client's namespace (ASCII, as ``check_namespace`` allows).
        count: how many keys (GET) or records (PUT) the body holds.

    Returns:
        The head's bytes.
    """
    name = namespace.encode("ascii")
    return REQUEST.pack(op, len(name), count) + name


def error_reply(status: Status, message: str) -> bytes:
    """A reply that is not OK, with its message.

    Args:
        status: the reply's status.
        message: what went wrong, cut to ``MAX_MESSAGE_BYTES`` once encoded.

    Returns:
        The reply's bytes.
    """
    text = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    return REPLY.pack(status, len(text)) + text


def put_reply(num_stored: int, already_present: Sequence[bool]) -> list[bytes]:
    """The OK reply to a put.

    Args:
        num_stored: records the server holds of the put (stored now or held before).
        already_present: per record of the put, in request order, whether its key was held
            before the put.

    Returns:
        The reply's buffers: its head, then one flag byte per record.
    """
    return [REPLY.pack(Status.OK, num_stored), bytes(already_present)]


def already_present_flags(raw: bytes, count: int) -> list[bool]:
    """The flags of an OK put reply, read back.

    Args:
        raw: the bytes after the reply head (as many as were read).
        count: how many records the put sent.

    Returns:
        Per record, in request order, whether the server held its key before the put.

    Raises:
        TierUnavailableError: fewer than ``count`` bytes, or a byte other than 0 or 1 (not
            a reply of this protocol).
    """
    if len(raw) != count:
        raise TierUnavailableError(
            f"transfer server's put reply has {len(raw)} already-present flags for {count} records"
        )
    if raw.translate(None, b"\x00\x01"):  # what is left is neither 0 nor 1
        raise TierUnavailableError(
            "transfer server's put reply has an already-present flag other than 0 or 1"
        )
    return [flag == 1 for flag in raw]


def failure(status: int, message: str) -> Exception:
    """The client-side error of a reply that is not OK.

    Args:
        status: the reply's status byte.
        message: the reply's message.

    Returns:
        ``RequestRefusedError`` when the request itself was refused (retrying cannot help),
        ``TierUnavailableError`` when the server is busy, failed or said something unknown.
    """
    try:
        name = Status(status).name.lower()
    except ValueError:
        return TierUnavailableError(f"transfer server answered unknown status {status}")
    what = f"transfer server answered {name}: {message}"
    if status in (Status.BUSY, Status.FAILED):
        return TierUnavailableError(what)
    return RequestRefusedError(what)
