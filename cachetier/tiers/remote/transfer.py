"""The remote tier's block transfer client: batch gets and puts on the server's transfer port
(``cachetier.protocol.transfer_frames``), from the caller's thread, over pooled blocking sockets.

A get reads each record straight into the caller's buffer (a KV pool block) or a fresh one,
checksummed chunk by chunk as it arrives; a put sends each record's parts with vectored writes.
Errors: ``OSError`` (refused, reset, timed out) and ``TierUnavailableError`` (garbage) are
worth a retry; ``ServerBusyError`` (``BUSY``) asks the client to back off; ``RequestRefusedError``
is not worth a retry.
"""

from __future__ import annotations

import ssl
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cachetier.errors import CorruptBlockError, TierUnavailableError
from cachetier.primitives.keys import BlockHash
from cachetier.protocol.sockets import BoundedReader, BufferedSocket, SocketPool
from cachetier.protocol.transfer_frames import (
    LENGTH,
    MAX_MESSAGE_BYTES,
    REPLY,
    Op,
    Status,
    already_present_flags,
    failure,
    hello,
    request,
)
from cachetier.record import (
    Buffer,
    KVBlock,
    encode_parts,
    plain_record_nbytes,
    read_record,
    record_nbytes,
)
from cachetier.tiers.remote.busy import ServerBusyError, wait_in
from cachetier.util.landing import Destination

# Bytes of records a put sends per write at least (see ``TransferClient._put``).
_SEND_RUN_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TransferPeer:
    """Whom a transfer connection talks to, and as whom.

    Args:
        where: ``(host, port)`` of the transfer port, or the path of the transfer socket.
        server_id: the id the server's hello must answer with (``None``: any).
        token: bearer token (names the tenant), ``None`` in open mode.
        tenant: the tenant the token must act as, if set.
        connect_timeout_s: longest wait for the connection (and its TLS handshake).
        timeout_s: longest wait for one read or write.
        tls: client context for a TCP port that speaks TLS (the certificate must name the
            host of ``where``), ``None`` for plain TCP and the Unix socket.
    """

    where: tuple[str, int] | str
    server_id: int | None
    token: str | None = field(repr=False)
    tenant: str | None
    connect_timeout_s: float
    timeout_s: float
    tls: ssl.SSLContext | None = None


class TransferConnection:
    """One connection, past its hello (the server knows its tenant).

    Args:
        peer: the server, and the token to say who this is.

    Raises:
        OSError: no connection (``ssl.SSLError``: a failed handshake, a certificate that does
            not verify).
        RequestRefusedError: the server refused the token.
        TierUnavailableError: another server answered.
    """

    def __init__(self, peer: TransferPeer) -> None:
        where = peer.where
        if isinstance(where, str):
            self.io = BufferedSocket.connect_unix(where, peer.connect_timeout_s, peer.timeout_s)
        else:
            self.io = BufferedSocket.connect_tcp(
                *where, peer.connect_timeout_s, peer.timeout_s, tls=peer.tls
            )
        try:
            self.io.send([hello(peer.token, peer.tenant)])
            answered = read_reply(self.io)
            if peer.server_id is not None and answered != peer.server_id:
                # E.g. a socket path that exists here but belongs to another server.
                raise TierUnavailableError(
                    f"the transfer endpoint {where!r} belongs to another server"
                )
        except BaseException:
            self.io.close()
            raise

    def is_stale(self) -> bool:
        return self.io.is_stale()

    def close(self) -> None:
        self.io.close()


def read_reply(io: BufferedSocket) -> int:
    """Read a reply head: its value when OK; raises the reply's error otherwise."""
    status, value = REPLY.unpack(io.read_exactly(REPLY.size))
    if status == Status.OK:
        return int(value)
    message = io.read_exactly(min(value, MAX_MESSAGE_BYTES)).decode("utf-8", "replace")
    if status == Status.BUSY:
        raise ServerBusyError(f"transfer server answered busy: {message}", wait_in(message))
    raise failure(status, message)


def _read_flags(io: BufferedSocket, count: int) -> list[bool]:
    """The already-present flags after an OK put reply's head."""
    try:
        raw = io.read_exactly(count)
    except OSError as exc:
        # The head came, so the server is up: a reply that then closes or goes silent past the
        # read timeout is a bad answer (a server from before the flags sends none), and the
        # pool drops the connection, which is out of step after it.
        raise TierUnavailableError(
            f"transfer server's put reply ended before its {count} already-present flags"
            f" ({type(exc).__name__}); a server older than this client sends none"
        ) from exc
    return already_present_flags(raw, count)


@dataclass(frozen=True, slots=True)
class PutAnswer:
    """What one put request was answered.

    Args:
        stored: records the server holds of the put (stored now or held already).
        already_present: per record, in request order, whether the server held its key
            before the put (records are immutable: it kept its own, the one sent was dropped).
    """

    stored: int
    already_present: list[bool]


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one get request brought back.

    Args:
        blocks: per answered key (the leading ones), its checked block or ``None``; a record
            that failed its checks is ``None`` too, and listed in ``corrupt``.
        nbytes: record bytes of the blocks.
        corrupt: the keys of the records that failed their checks.
    """

    blocks: list[KVBlock | None]
    nbytes: int
    corrupt: list[BlockHash]


class TransferClient:
    """Requests to one server's transfer endpoint; safe to use from many threads.

    Args:
        peer: the server's transfer port or socket, and the token to say who this is.
        max_connections: connections kept at most.
        max_record_bytes: largest record accepted from the server.
    """

    def __init__(self, peer: TransferPeer, *, max_connections: int, max_record_bytes: int) -> None:
        self.peer = peer
        self.where = peer.where
        self.server_id = peer.server_id
        self.tls = peer.tls is not None
        self._max_record_bytes = max_record_bytes
        self._pool: SocketPool[TransferConnection] = SocketPool(
            lambda: TransferConnection(peer),
            max_connections,
            peer.timeout_s,
        )

    def get(
        self,
        namespace: str,
        keys: Sequence[BlockHash],
        dests: Sequence[Destination] | None = None,
    ) -> Fetched:
        """Fetch records of ``keys`` and check them against the keys.

        Args:
            namespace: the client's namespace.
            keys: keys to fetch (at least one).
            dests: per key, where an uncompressed payload of exactly its size should land.

        Returns:
            The blocks of the leading keys the server answered (at least one).
        """
        with self._pool.connection() as conn:
            io = conn.io
            io.send([request(Op.GET, namespace, len(keys)), b"".join(keys)])
            count = read_reply(io)
            if not 0 < count <= len(keys):
                raise TierUnavailableError(f"server answered {count} records for {len(keys)}")
            lengths = struct.unpack(f"<{count}Q", io.read_exactly(count * LENGTH.size))
            if max(lengths) > self._max_record_bytes:
                raise TierUnavailableError(f"server sent a record of {max(lengths)} bytes")
            blocks: list[KVBlock | None] = []
            nbytes = 0
            corrupt: list[BlockHash] = []
            for i, length in enumerate(lengths):
                if length == 0:
                    blocks.append(None)
                    continue
                body = BoundedReader(io, length)
                into = None if dests is None else dests[i]
                try:
                    blocks.append(
                        read_record(body.readinto, length, key=keys[i], payload_into=into)
                    )
                    nbytes += length
                except CorruptBlockError:
                    io.skip(body.left)  # stay in step for the records after it
                    blocks.append(None)
                    corrupt.append(keys[i])
            return Fetched(blocks, nbytes, corrupt)

    def put(self, namespace: str, records: Sequence[Sequence[Buffer]]) -> int:
        """Store records (each as its parts, ``encode_parts``) in one request.

        Returns:
            How many the server stored (or held already).
        """
        return self.put_reporting(namespace, records).stored

    def put_reporting(self, namespace: str, records: Sequence[Sequence[Buffer]]) -> PutAnswer:
        """``put``, and which of the records the server held already.

        Args:
            namespace: the client's namespace.
            records: the records to store, each as its parts (``encode_parts``).

        Returns:
            The server's answer.

        Raises:
            TierUnavailableError: the reply's flags are short or not flags (the connection is
                dropped); otherwise as ``put``.
        """
        lengths = [record_nbytes(parts) for parts in records]
        return self._put(namespace, lengths, iter(records))

    def put_blocks(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        """Store blocks, uncompressed, in one request; each is encoded (hashed) just before it
        is sent, so the server reads one record while the next is hashed here.

        Returns:
            How many the server stored (or held already).
        """
        lengths = [plain_record_nbytes(b) for b in blocks]
        return self._put(namespace, lengths, (encode_parts(b) for b in blocks)).stored

    def _put(
        self, namespace: str, lengths: list[int], records: Iterator[Sequence[Buffer]]
    ) -> PutAnswer:
        count = len(lengths)
        head = [request(Op.PUT, namespace, count), struct.pack(f"<{count}Q", *lengths)]
        with self._pool.connection() as conn:
            # Records go out in runs of at least _SEND_RUN_BYTES: a large record by itself (the
            # next is hashed while the server reads it), small ones several per vectored write.
            run: list[Buffer] = head
            run_bytes = 0
            for parts in records:  # announced as ``lengths`` (a test holds the two equal)
                run.extend(parts)
                run_bytes += record_nbytes(parts)
                if run_bytes >= _SEND_RUN_BYTES:
                    conn.io.send(run)
                    run, run_bytes = [], 0
            conn.io.send(run)
            stored = read_reply(conn.io)
            return PutAnswer(stored, _read_flags(conn.io, count))

    def close(self) -> None:
        self._pool.close()
