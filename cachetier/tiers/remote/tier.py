"""``RemoteTier``: the tier interface against a cachetier server.

Two faces over one private event loop (a background thread per tier, holding the pooled
aiohttp session):

- the ``Tier`` methods (``get_many``...), blocking, for callers on a plain thread such as the
  engine loop: each submits a coroutine to the private loop and waits a bounded time;
- ``aget_many``, ``aput_many``, ... for async callers, awaitable from any event loop.

When the server takes block transfers (``/v1/limits`` names its port, its Unix socket or
both), the blocking ``get_many``, ``get_into`` and ``put_many`` move their blocks that way
instead (``transfer``): over the socket when its path exists on this host, else the port; from
the caller's thread, records read straight into the caller's buffers, no HTTP. Lookups, deletes
and the async API stay on HTTP.

TLS. An ``https://`` url makes HTTP and the transfer port speak TLS with one client context
(``ca_file``, chain and host name verified unless ``tls_verify`` is off). The port is used only
if the server says it speaks TLS: the token is never sent in clear to a plaintext port. A
certificate that does not verify is a miss and a counted error (``tls_failures`` in stats),
not retried, and logged at most once per ``failures.TLS_LOG_INTERVAL_S``. Log lines and errors
never show the token (``cachetier.util.redact``).

A transfer port that refuses or dies is not an outage: the call is done over HTTP, the port
is probed again after a backoff and used again once it answers (``fallback``; ``fallbacks`` in
stats). A server that answers busy (429 or 503 with ``Retry-After``, ``BUSY``: past this
tenant's share) is not one either: the call is a miss, the breaker is not told, and calls until
the hinted time are misses made without calling (``busy``).

A server that is down, slow or restarting turns into misses and counted errors: each request
goes through a ``Guard`` (``cachetier.util.backoff``; what each failure means is ``failures``), is
retried with exponential backoff, and a circuit breaker stops calling after
``failure_threshold`` failed calls in a row until a backoff has passed. Every record fetched is
decoded and checked against the key asked for; a bad one is a miss and counted as corrupt.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from cachetier.errors import CorruptBlockError, RequestRefusedError, TierUnavailableError
from cachetier.primitives.keys import BlockHash
from cachetier.record import (
    KVBlock,
    decode_record,
    encode_parts,
    plain_record_nbytes,
    record_nbytes,
)
from cachetier.tiers.base import Tier, check_namespace, land_in
from cachetier.tiers.prefix import PrefixHit
from cachetier.tiers.remote.batching import RequestLimits
from cachetier.tiers.remote.busy import ServerBusyError
from cachetier.tiers.remote.checks import check_blocks, check_keys
from cachetier.tiers.remote.client import RemoteClient
from cachetier.tiers.remote.config import RemoteTierConfig
from cachetier.tiers.remote.failures import TRANSIENT, RequestFailures
from cachetier.tiers.remote.fallback import TransferFallback
from cachetier.tiers.remote.loop import LoopThread
from cachetier.tiers.remote.route import pick_transfer, transfer_label
from cachetier.tiers.remote.transfer import TransferClient
from cachetier.util.backoff import CircuitBreaker, Clock, ExponentialBackoff
from cachetier.util.landing import Destination, normalize
from cachetier.util.tls import client_context

_T = TypeVar("_T")

# The server checked the record when its tier read it (and drops a record its tier finds
# corrupt): one that fails here went bad on the way, so the server's copy is not dropped.
_ON_ARRIVAL = "failed its checks on arrival from the server"


class RemoteTier(Tier):
    """Blocks kept by a cachetier server, under the tenant of this tier's token.

    Args:
        config: the server's URL, the token, timeouts, retries and breaker settings.
        clock: time source of the circuit breaker (tests inject one instead of sleeping).
    """

    name = "remote"
    over_network = True

    def __init__(self, config: RemoteTierConfig, *, clock: Clock = time.monotonic) -> None:
        super().__init__(clock=clock)
        self._config = config
        backoff = ExponentialBackoff(config.backoff_base_s, config.backoff_cap_s)
        self._breaker = CircuitBreaker(config.failure_threshold, backoff, clock)
        self._failures = RequestFailures(config, self._stats, clock, self._forget_limits)
        self._guard = self._failures.guard(self._breaker, backoff)
        # Reads ca_file now: a bad path fails here, clearly, not as an error on every call.
        self._tls = client_context(config.ca_file, config.tls_verify) if config.tls else None
        self._client = RemoteClient(config, self._tls)
        # The stricter of the config's and the server's limits, once the server has said.
        self._limits = config.limits
        self._limits_known = False
        self._loop = LoopThread("cachetier-remote")
        self._transfer: TransferClient | None = None  # set once the server names its port
        self._fallback = TransferFallback(config.backoff_base_s, clock)

    @property
    def config(self) -> RemoteTierConfig:
        return self._config

    @property
    def capacity_bytes(self) -> None:
        """``None``: the server enforces its own capacities."""
        return None

    @property
    def used_bytes(self) -> int:
        """0: the server accounts for its bytes (its ``/v1/stats``), not this client."""
        return 0

    # Blocking facade (the Tier interface).

    def put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        check_blocks(namespace, blocks)
        if self._transfer_client() is not None:
            return self._put_transfer(namespace, blocks)
        return self._put_http(namespace, blocks)

    def _put_http(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        num_requests = self._limits.num_put_requests(blocks)
        return self._wait(self._put_many(namespace, blocks), 0, num_requests)

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        check_keys(namespace, keys)
        if self._transfer_client() is not None:
            return self._get_transfer(namespace, keys, None)
        return self._get_http(namespace, keys)

    def _get_http(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        misses: list[KVBlock | None] = [None] * len(keys)
        num_requests = self._limits.num_requests(len(keys), self._limits.max_batch_blocks)
        return self._wait(self._get_many(namespace, keys), misses, num_requests)

    def get_into(
        self, namespace: str, keys: Sequence[BlockHash], dests: Sequence[Destination]
    ) -> list[KVBlock | None]:
        if self._transfer_client() is None:
            return super().get_into(namespace, keys, dests)
        check_keys(namespace, keys)
        if len(dests) != len(keys):
            raise ValueError(f"{len(dests)} destinations for {len(keys)} keys")
        targets = [normalize(d) for d in dests]
        return land_in(self._get_transfer(namespace, keys, targets), targets)

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        return self.lookup(namespace, keys).num_blocks

    def lookup(self, namespace: str, keys: Sequence[BlockHash]) -> PrefixHit:
        """The server's answer: the leading run of ``keys`` it stores, and in which of its
        tiers (``PrefixHit.tier_names`` are the server's tiers).

        Args:
            namespace: storage namespace (see ``check_namespace``).
            keys: block keys in sequence order.

        Returns:
            The run; empty when the server cannot be reached.
        """
        check_keys(namespace, keys)
        num_requests = self._limits.num_requests(len(keys), self._limits.max_keys)
        return self._wait(self._lookup(namespace, keys), _NO_HIT, num_requests)

    def delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        check_keys(namespace, keys)
        num_requests = self._limits.num_requests(len(keys), self._limits.max_keys)
        return self._wait(self._delete(namespace, keys), 0, num_requests)

    def clear(self, namespace: str) -> int:
        check_namespace(namespace)
        return self._wait(self._call(lambda: self._client.clear(namespace), 0), 0, 1)

    def report_quarantine(self, namespace: str, reason: str, writer: str = "") -> None:
        """Share a quarantine with the server, which then quarantines ``writer``'s records of
        ``namespace`` (all of them if empty) in its own tiers for every client (a failure is
        logged: the local quarantine holds regardless)."""
        check_namespace(namespace)
        report = self._client.report_quarantine
        self._wait(self._call(lambda: report(namespace, reason, writer), 0), 0, 1)

    # Async API: the same operations for callers on any event loop. Arguments, results and
    # failure handling are those of the blocking methods above (and of ``Tier``).

    async def aput_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        """``put_many`` for async callers."""
        check_blocks(namespace, blocks)
        return await self._loop.run_async(self._put_many(namespace, blocks))

    async def aget_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        """``get_many`` for async callers."""
        check_keys(namespace, keys)
        return await self._loop.run_async(self._get_many(namespace, keys))

    async def alookup(self, namespace: str, keys: Sequence[BlockHash]) -> PrefixHit:
        """``lookup`` for async callers."""
        check_keys(namespace, keys)
        return await self._loop.run_async(self._lookup(namespace, keys))

    async def acontains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """``contains_prefix`` for async callers."""
        return (await self.alookup(namespace, keys)).num_blocks

    async def adelete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        """``delete`` for async callers."""
        check_keys(namespace, keys)
        return await self._loop.run_async(self._delete(namespace, keys))

    async def aclear(self, namespace: str) -> int:
        """``clear`` for async callers."""
        check_namespace(namespace)
        return await self._loop.run_async(self._call(lambda: self._client.clear(namespace), 0))

    # The operations, run on the private loop.

    async def _put_many(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        if self._breaker.is_open:  # the call would be skipped: do not encode for nothing
            self._failures.skipped()
            return 0
        start = time.perf_counter()
        limits = await self._fetch_limits()
        records = [encode_parts(b) for b in blocks]
        sizes = [record_nbytes(r) for r in records]
        groups, too_large = limits.put_groups(sizes)
        stored: list[int] = []
        for group in groups:
            chunk = [records[i] for i in group]
            got = await self._call(lambda c=chunk: self._client.put(namespace, c), None)
            if got is None:
                break
            stored.append(got)
        return self._count_put(groups, sizes, stored, too_large, start)

    def _put_transfer(self, namespace: str, blocks: Sequence[KVBlock]) -> int:
        """``_put_many`` over the transfer port, on the calling thread. Each record is encoded
        just before it is sent (its length is known without hashing), so the checksum of the
        next record is computed while the server still reads this one."""
        if self._breaker.is_open:
            self._failures.skipped()
            return 0
        start = time.perf_counter()
        sizes = [plain_record_nbytes(b) for b in blocks]
        groups, too_large = self._limits.put_groups(sizes)
        stored: list[int] = []
        for n, group in enumerate(groups):
            chunk = [blocks[i] for i in group]
            got = self._call_blocking(lambda t, c=chunk: t.put_blocks(namespace, c), None)
            if got is _FALL_BACK:  # the port failed: this group and the rest over HTTP
                self._fallback.fell_back()
                rest = [blocks[i] for g in groups[n:] for i in g]
                done = self._count_put(groups[:n], sizes, stored, too_large, start)
                return done + self._put_http(namespace, rest)
            if got is None:
                break
            stored.append(got)
        return self._count_put(groups, sizes, stored, too_large, start)

    def _count_put(
        self,
        groups: list[list[int]],
        sizes: Sequence[int],
        stored: list[int],
        too_large: int,
        start: float,
    ) -> int:
        """Count a put whose first ``len(stored)`` requests were answered; returns the blocks
        stored."""
        nbytes = sum(sizes[i] for group in groups[: len(stored)] for i in group)
        self._stats.add(puts=sum(stored), bytes_in=nbytes, rejected=too_large)
        self._stats.observe(time.perf_counter() - start)
        return sum(stored)

    def _get_transfer(
        self,
        namespace: str,
        keys: Sequence[BlockHash],
        dests: Sequence[Destination] | None,
    ) -> list[KVBlock | None]:
        """``_get_many`` over the transfer port, on the calling thread."""
        start = time.perf_counter()
        out: list[KVBlock | None] = [None] * len(keys)
        hits = nbytes = corrupt = 0
        step = self._limits.max_batch_blocks
        first = 0
        handled = len(keys)  # the keys this transfer counts (HTTP counts those it takes over)
        while first < len(keys):
            chunk, into = keys[first : first + step], dests and dests[first : first + step]
            got = self._call_blocking(
                lambda t, c=chunk, d=into: t.get(namespace, c, d or None), None
            )
            if got is _FALL_BACK:  # the port failed: the rest over HTTP (landed by get_into)
                self._fallback.fell_back()
                out[first:] = self._get_http(namespace, keys[first:])
                handled = first
                break
            if got is None:
                break
            for i, block in enumerate(got.blocks):
                if block is not None:
                    out[first + i] = block
                    hits += 1
            nbytes += got.nbytes
            corrupt += len(got.corrupt)
            for key in got.corrupt:
                self._log_corrupt(key, _ON_ARRIVAL)
            first += len(got.blocks)  # the server may answer the leading keys only: ask again
        self._stats.add(hits=hits, misses=handled - hits, bytes_out=nbytes, corrupt=corrupt)
        self._stats.observe(time.perf_counter() - start)
        return out

    async def _get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        start = time.perf_counter()
        out: list[KVBlock | None] = [None] * len(keys)
        hits = nbytes = corrupt = 0
        step = (await self._fetch_limits()).max_batch_blocks
        first = 0
        while first < len(keys):
            chunk = keys[first : first + step]
            records = await self._call(lambda c=chunk: self._client.get(namespace, c), None)
            if records is None:
                break
            for i, record in enumerate(records):
                if record is None:
                    continue
                try:
                    out[first + i] = decode_record(record, key=chunk[i])
                except CorruptBlockError:
                    corrupt += 1
                    self._log_corrupt(chunk[i], _ON_ARRIVAL)
                    continue
                hits += 1
                nbytes += record.nbytes
            first += len(records)  # the server may answer the leading keys only: ask again
        self._stats.add(hits=hits, misses=len(keys) - hits, bytes_out=nbytes, corrupt=corrupt)
        self._stats.observe(time.perf_counter() - start)
        return out

    async def _lookup(self, namespace: str, keys: Sequence[BlockHash]) -> PrefixHit:
        spans: list[tuple[int, int, int]] = []
        names: list[str] = []
        pos = 0
        step = (await self._fetch_limits()).max_keys
        while pos < len(keys):
            chunk = keys[pos : pos + step]
            answer = await self._call(lambda c=chunk: self._lookup_once(namespace, c), None)
            if answer is None:
                break
            found, found_spans = answer
            for tier, start, end in found_spans:
                if tier not in names:
                    names.append(tier)
                spans.append((names.index(tier), pos + start, pos + end))
            pos += found
            if found < len(chunk):
                break
        return PrefixHit(pos, tuple(spans), tuple(names))

    async def _lookup_once(
        self, namespace: str, keys: Sequence[BlockHash]
    ) -> tuple[int, list[tuple[str, int, int]]]:
        answer = await self._client.lookup(namespace, keys)
        spans = [(str(s["tier"]), int(s["start"]), int(s["end"])) for s in answer["spans"]]
        found = int(answer["num_blocks"])
        if not 0 <= found <= len(keys):
            raise TierUnavailableError(f"server found {found} of {len(keys)} keys")
        return found, spans

    async def _delete(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        removed = 0
        step = (await self._fetch_limits()).max_keys
        for first in range(0, len(keys), step):
            chunk = keys[first : first + step]
            removed += await self._call(lambda c=chunk: self._client.delete(namespace, c), 0)
        return removed

    async def _fetch_limits(self, probing: bool = False) -> RequestLimits:
        """The request limits, asking the server for its own on first use."""
        if not self._limits_known and not self._breaker.is_open:
            try:
                server = await self._client.limits()
            except (*TRANSIENT, RequestRefusedError) as exc:
                if probing:  # no call follows to count the failure
                    self._failures.probe_failed(exc)
                return self._limits
            self._limits = self._config.limits.narrowed(server)
            old = self._transfer
            self._transfer = pick_transfer(self._config, self._tls, server.get("transfer"), old)
            if self._transfer is not old:  # a new endpoint (restarted server): try it at once
                self._fallback.reset()
            self._limits_known = True
        return self._limits

    def probe(self) -> None:
        """Read the server's limits now, one attempt; a failure is counted and said as a
        call's would be (``RequestFailures.probe_failed``), and the next call asks again."""
        self._wait(self._fetch_limits(probing=True), self._limits, 1)

    def _transfer_client(self) -> TransferClient | None:
        """The transfer client, reading the server's limits first if they are not known."""
        if self._config.transfer_host is None:
            return None
        if not self._limits_known and not self._breaker.is_open:
            self._wait(self._fetch_limits(), self._limits, 1)
        return self._transfer

    async def _call(self, op: Callable[[], Awaitable[_T]], failed: Any) -> Any:
        """Run one request with retries, unless the breaker is open or the server asked to
        wait (``busy``); ``failed`` if it fails or is not made."""
        if self._failures.busy.holding():
            return failed
        return await self._guard.acall(op, failed)

    def _call_blocking(self, op: Callable[[TransferClient], _T], failed: Any) -> Any:
        """One transfer on the calling thread, unless the breaker is open or the server asked
        to wait (``failed`` then, and when the server refuses or is busy). A failure of the
        port (refused, reset, timed out, garbage) is not the server's: it returns
        ``_FALL_BACK`` for the caller to go over HTTP, whose guard then retries and counts, and
        makes the next call read the server's limits first (a restarted server has a new id
        and maybe a new port)."""
        if self._failures.busy.holding():
            return failed
        if self._breaker.is_open:
            self._failures.skipped()
            return failed
        tried: TransferClient | None = None
        while True:
            transfer = self._transfer_client()
            if transfer is not None and transfer is tried:  # the same endpoint failed
                self._fallback.failed()
                return _FALL_BACK
            if transfer is None or not self._fallback.usable():
                return _FALL_BACK
            try:
                result = op(transfer)
            except (RequestRefusedError, ServerBusyError) as exc:
                self._failures.answered(exc)
                return failed
            except TRANSIENT as exc:
                if tried is not None:
                    self._fallback.failed()
                    return _FALL_BACK
                # Once more if the server's limits now name another endpoint (restarted).
                self._limits_known = False
                self._failures.retrying(exc)
                tried = transfer
                continue
            self._fallback.answered()
            self._breaker.record_success()
            return result

    def _forget_limits(self) -> None:
        """Ask the server for its limits again before the next call (they may have changed)."""
        self._limits_known = False

    # Plumbing between the callers' threads and loops and the private loop.

    def _wait(self, coro: Coroutine[Any, Any, _T], failed: _T, num_requests: int) -> _T:
        # Each request has its own timeout; this bound only trips if the loop itself is stuck.
        budget = num_requests * self._config.call_budget_s + 1.0
        try:
            return self._loop.run(coro, budget)
        except TierUnavailableError:
            self._stats.add(errors=1)
            return failed

    def stats(self) -> dict[str, Any]:
        """``Tier.stats`` plus ``skipped`` (calls not made: breaker open), ``retries``,
        ``tls_failures`` (failed TLS handshakes, also in ``errors``), ``breaker``
        (``CircuitBreaker.snapshot``), ``transfer`` (where block transfers go:
        ``"unix:<path>"``, ``"tcp:<host>:<port>"``, ``"tls:<host>:<port>"``, or ``None`` for
        HTTP), ``busy`` and ``deferred`` (``busy.BusyHold``), and ``fallbacks``,
        ``transfer_failures`` and ``transfer_down`` (``fallback.TransferFallback``)."""
        out = super().stats()
        out["transfer"] = transfer_label(self._transfer)
        out.update(self._failures.snapshot())
        out.update(self._fallback.snapshot())
        out["breaker"] = self._breaker.snapshot()
        return out

    def close(self) -> None:
        if self._transfer is not None:
            self._transfer.close()
        self._loop.close(self._client.close())


_NO_HIT = PrefixHit(0, (), ())
_FALL_BACK: Any = object()  # a transfer's answer when the port failed: go over HTTP
