"""The transfer port's requests: one batch get or put, past the connection's hello.

Limits are the server's own (``max_block_bytes``, ``max_batch_bytes``, ``max_batch_blocks``),
checked from the lengths before any record is read, and a record's decompressed size from its
head before it is decompressed; what a put holds counts against the service's ``inflight``
budget (``BUSY`` when it does not fit). Each request also counts against its tenant's shares
(``fairness``: its request rate, its upload bytes); past them it is answered ``BUSY`` with the
wait, its body read so the connection stays in step. A put's records are read with
``recv_into`` straight into the buffers the CPU tier then keeps, checksummed chunk by chunk as
they arrive; a get's records are sent from the tier's buffers with vectored writes.
``transfer`` owns the sockets, the hello and the deadlines around each request.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TypeVar

from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import BlockHash
from cachetier.protocol.sockets import BoundedReader, BufferedSocket
from cachetier.protocol.transfer_frames import KEY_BYTES, LENGTH, REPLY, Op, Status, put_reply
from cachetier.record import PEEK_BYTES, Buffer, KVBlock, peek_inflated_nbytes, read_record
from cachetier.server.auth import Scope
from cachetier.server.budget import Hold
from cachetier.server.fairness import MAX_HOLD_S, UPLOAD_RETRY_S, busy_message
from cachetier.server.scheduling import Held
from cachetier.server.service import BlockService
from cachetier.server.watchdog import Deadline

_T = TypeVar("_T")


class Refused(Exception):
    """A request answered with an error; ``close`` when the stream is out of step after it.

    Args:
        status: the reply's status.
        message: the reply's message.
        close: whether the server closes the connection after the reply.
        hold_s: how long the connection is not read again after the reply: a tenant past its
            request rate waits out its turn on the connection's thread instead of making the
            server answer ``BUSY`` as fast as it can ask (each answer is the server's CPU,
            which the other tenants need).
    """

    def __init__(
        self, status: Status, message: str, *, close: bool = True, hold_s: float = 0.0
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.hold_s = hold_s


class TransferRequests:
    """Serves the transfer port's requests against a ``BlockService``.

    Args:
        service: the server's blocks, tenants and limits.
        body_timeout_s: a request's records must arrive, and its answer be sent, within this
            many seconds of its head.
    """

    def __init__(self, service: BlockService, body_timeout_s: float) -> None:
        self._service = service
        self._body_timeout_s = body_timeout_s

    def serve(
        self,
        io: BufferedSocket,
        deadline: Deadline,
        tenant: str,
        op: int,
        name_len: int,
        count: int,
    ) -> list[Buffer]:
        """Serve one request whose head was read.

        Args:
            io: the connection, its hello done.
            deadline: the request's deadline, running since its first byte; restarted for
                the body once the keys or lengths are in.
            tenant: the connection's tenant (from its hello's token).
            op: the head's operation byte.
            name_len: the head's namespace length.
            count: the head's number of keys or records.

        Returns:
            The reply's buffers, to send in order.

        Raises:
            Refused: the request is answered with an error (``close`` says whether the
                connection is out of step after it).
        """
        name = io.read_exactly(name_len)
        try:
            scope = Scope.of(tenant, name.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise Refused(Status.BAD_REQUEST, f"bad namespace: {exc}") from None
        config = self._service.config
        if count > config.max_batch_blocks:
            raise Refused(
                Status.TOO_LARGE, f"{count} blocks, at most {config.max_batch_blocks} per request"
            )
        wait_s = self._service.tokens.shares.admit(tenant)
        if op == Op.GET:
            raw = io.read_exactly(count * KEY_BYTES)
            deadline.start(self._body_timeout_s)  # the head is in: the answer's time
            if wait_s is not None:
                raise _over_rate(tenant, wait_s)
            keys = [BlockHash(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]
            return self._in_slot(tenant, lambda: self._get(scope, keys))
        if op == Op.PUT:
            lengths = struct.unpack(f"<{count}Q", io.read_exactly(count * LENGTH.size))
            deadline.start(self._body_timeout_s)  # the head is in: the records' time
            return self._put(io, scope, lengths, wait_s)
        raise Refused(Status.BAD_REQUEST, f"unknown operation {op}")

    def _in_slot(self, tenant: str, work: Callable[[], _T]) -> _T:
        """Run a request's work in a slot of its tenant's fair share (``scheduling``)."""
        scheduler = self._service.scheduler
        got = scheduler.acquire_blocking(tenant)
        if not isinstance(got, Held):
            what = f"tenant {tenant} is past its share of the server's capacity"
            raise Refused(
                Status.BUSY, busy_message(what, got), close=False, hold_s=min(got, MAX_HOLD_S)
            )
        try:
            return work()
        finally:
            scheduler.release(got)

    def _get(self, scope: Scope, keys: Sequence[BlockHash]) -> list[Buffer]:
        budget = self._service.config.max_batch_bytes
        records = self._service.get_records(scope, keys, budget)
        lengths = [0 if r is None else sum(memoryview(p).nbytes for p in r) for r in records]
        out: list[Buffer] = [
            REPLY.pack(Status.OK, len(records)),
            struct.pack(f"<{len(lengths)}Q", *lengths),
        ]
        for parts in records:
            if parts is not None:
                out.extend(parts)
        return out

    def _put(
        self, io: BufferedSocket, scope: Scope, lengths: Sequence[int], wait_s: float | None
    ) -> list[Buffer]:
        config = self._service.config
        for i, length in enumerate(lengths):
            if not 0 < length <= config.max_block_bytes:
                self._service.refuse(scope, len(lengths))
                raise Refused(
                    Status.TOO_LARGE if length else Status.BAD_REQUEST,
                    f"record {i} is {length} bytes; 1 to {config.max_block_bytes} are allowed",
                )
        total = sum(lengths)
        if total > config.max_batch_bytes:
            self._service.refuse(scope, len(lengths))
            raise Refused(
                Status.TOO_LARGE,
                f"batch of {total} bytes, at most {config.max_batch_bytes} per request",
            )
        if wait_s is not None:
            io.skip(total)  # the connection stays in step; the client retries later
            raise _over_rate(scope.tenant, wait_s)
        uploads = self._service.tokens.shares.uploads
        if not uploads.try_take(scope.tenant, total):
            io.skip(total)
            what = f"tenant {scope.tenant} holds its share of the server's uploads"
            raise Refused(Status.BUSY, busy_message(what, UPLOAD_RETRY_S), close=False)
        held = Hold(self._service.inflight)
        try:
            if not held.take(total):
                io.skip(total)  # the connection stays in step; the client retries later
                raise Refused(Status.BUSY, _no_room(total, held), close=False)
            blocks = self._read_records(io, scope, lengths, held)
            stored = self._in_slot(scope.tenant, lambda: self._service.put_reporting(scope, blocks))
        finally:
            held.release()
            uploads.give(scope.tenant, total)
        return list(put_reply(max(stored.tiers.values(), default=0), stored.already_present))

    def _read_records(
        self, io: BufferedSocket, scope: Scope, lengths: Sequence[int], held: Hold
    ) -> list[KVBlock]:
        """Read and check a put's records (their sizes were checked), holding in ``held``
        what decompressing them takes before it is allocated."""
        blocks: list[KVBlock] = []
        raw_so_far = 0
        for i, length in enumerate(lengths):
            body = BoundedReader(io, length)
            max_raw = self._service.max_raw_bytes(raw_so_far)
            # Its head first: what it claims decompressed is held before a byte is allocated.
            head = _read_head(body, min(PEEK_BYTES, length))
            claim = min(peek_inflated_nbytes(head), max_raw)  # more is refused on the head
            if not held.take(claim):
                io.skip(body.left + sum(lengths[i + 1 :]))
                raise Refused(Status.BUSY, _no_room(claim, held), close=False)
            reader = _Prefixed(head, body.readinto)
            try:
                block = read_record(
                    reader.readinto, length, fingerprint=scope.fingerprint, max_raw_bytes=max_raw
                )
            except CorruptBlockError as exc:
                # Read the rest of the request (its size was checked) so the connection stays
                # in step, then refuse all of it: nothing of a request with a bad record is kept.
                io.skip(body.left + sum(lengths[i + 1 :]))
                self._service.refuse(scope, len(lengths))
                raise Refused(Status.BAD_REQUEST, f"record {i}: {exc}", close=False) from None
            raw_so_far += memoryview(block.data).nbytes
            blocks.append(block)
        return blocks


def _over_rate(tenant: str, wait_s: float) -> Refused:
    what = f"tenant {tenant} is past its share of the server's request rate"
    return Refused(
        Status.BUSY, busy_message(what, wait_s), close=False, hold_s=min(wait_s, MAX_HOLD_S)
    )


def _no_room(nbytes: int, held: Hold) -> str:
    return (
        f"{nbytes} more bytes do not fit in the {held.budget.limit_bytes} bytes of uploads the"
        " server holds at once; retry shortly"
    )


def _read_head(body: BoundedReader, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a record (fewer if the connection ends first: the record's own
    read then says it is short)."""
    head = memoryview(bytearray(nbytes))
    got = 0
    while got < nbytes:
        n = body.readinto(head[got:])
        if n <= 0:
            break
        got += n
    return head[:got]


class _Prefixed:
    """Reads of a record whose head was read ahead: the head first, then the rest."""

    def __init__(self, head: memoryview, rest: Callable[[memoryview], int]) -> None:
        self._head = head
        self._rest = rest

    def readinto(self, dest: memoryview) -> int:
        if self._head.nbytes:
            n = min(dest.nbytes, self._head.nbytes)
            dest[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest(dest)
