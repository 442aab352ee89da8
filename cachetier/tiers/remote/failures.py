"""What a failed request to the cachetier server means, and how the remote tier counts it.

A refused or reset connection, a 5xx or an answer that is not one may succeed on a retry. A
timeout is not retried (a server too slow once is likely to be again, and the caller is
waiting), nor is a certificate that does not verify; a 4xx (``RequestRefusedError``) says the
server is up and said no, and a busy answer (``busy``) that it is up and asks to wait: neither
counts against the breaker. A failed TLS handshake is counted (``tls_failures``) and warned about
at most once per ``TLS_LOG_INTERVAL_S``. Log lines never show the token (``cachetier.util.redact``).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable

import aiohttp

from cachetier.errors import RequestRefusedError, TierUnavailableError
from cachetier.tiers.remote.busy import BusyHold, ServerBusyError
from cachetier.tiers.remote.config import RemoteTierConfig
from cachetier.tiers.stats import TierStats
from cachetier.util.backoff import CircuitBreaker, Clock, ExponentialBackoff, Fault, Guard
from cachetier.util.redact import redact
from cachetier.util.throttle import DownLog, LogThrottle

logger = logging.getLogger(__name__)
TLS_LOG_INTERVAL_S = 60.0  # least time between two warnings of a failed TLS handshake
# What a request that fails this way may succeed on retry: the server is down, restarting,
# slow, or sent something that is not a valid answer (KeyError/TypeError/ValueError: a reply
# without the fields an answer has).
TRANSIENT = (
    aiohttp.ClientError,
    TimeoutError,
    OSError,
    TierUnavailableError,
    KeyError,
    TypeError,
    ValueError,
)
# A server whose certificate does not verify will not verify on a retry either.
_UNTRUSTED = (ssl.SSLCertVerificationError, aiohttp.ClientConnectorCertificateError)
_TLS_ERRORS = (ssl.SSLError, aiohttp.ClientSSLError)


def request_fault(exc: BaseException) -> Fault | None:
    """The ``Fault`` a failed request is, or ``None`` for one that is not the server's.

    Args:
        exc: what the request raised.

    Returns:
        ``ANSWERED`` for a refusal, ``DOWN`` for a timeout or an untrusted certificate,
        ``TRANSIENT`` for the rest of ``TRANSIENT``; ``None`` for a cancellation or a bug.
    """
    if isinstance(exc, (RequestRefusedError, ServerBusyError)):
        return Fault.ANSWERED  # busy is an answer too: the server is up (``busy``)
    if isinstance(exc, (TimeoutError, *_UNTRUSTED)):
        return Fault.DOWN
    if isinstance(exc, TRANSIENT):
        return Fault.TRANSIENT
    return None


class RequestFailures:
    """The remote tier's account of failed requests: counters, warnings, and its guard.

    Args:
        config: the tier's settings (the url warnings name, the token they mask, retries).
        stats: the tier's counters (a call that fails for good is one of its ``errors``).
        clock: time source of the TLS warning throttle.
        on_refused: told when the server refuses a request (e.g. its limits went down).
    """

    def __init__(
        self,
        config: RemoteTierConfig,
        stats: TierStats,
        clock: Clock,
        on_refused: Callable[[], None],
    ) -> None:
        self._config = config
        self._stats = stats
        self._on_refused = on_refused
        self._tls_log = LogThrottle(TLS_LOG_INTERVAL_S, clock)
        self._down_log = DownLog(
            logger, "the cachetier server", redact(config.base_url), clock=clock
        )
        backoff = ExponentialBackoff(config.backoff_base_s, config.backoff_cap_s)
        self.busy = BusyHold(backoff, clock)  # holds calls after a busy answer
        self._lock = threading.Lock()
        self._num_skipped = 0
        self._num_retries = 0

    def guard(self, breaker: CircuitBreaker, backoff: ExponentialBackoff) -> Guard:
        """The guard of the tier's requests: retries after ``backoff``, counted here.

        Args:
            breaker: the tier's breaker.
            backoff: delay before each retry.

        Returns:
            A ``Guard`` whose failures, retries and skipped calls this object counts.
        """
        return Guard(
            breaker,
            request_fault,
            on_failure=self._failed,
            on_skipped=self.skipped,
            backoff=backoff,
            retries=self._config.retries,
            on_retry=self.retrying,
        )

    def skipped(self) -> None:
        """Count a call not made because the breaker was open."""
        with self._lock:
            self._num_skipped += 1

    def describe(self, exc: BaseException) -> str:
        """``repr(exc)`` with the token and any URL password masked (an aiohttp error's repr
        can carry the request's headers).

        Args:
            exc: the error.

        Returns:
            Its masked repr.
        """
        return redact(repr(exc), [self._config.token])

    def snapshot(self) -> dict[str, int]:
        """``skipped``, ``retries``, ``tls_failures`` (failed handshakes, also errors),
        ``busy`` (busy answers, not errors) and ``deferred`` (calls not made after one)."""
        with self._lock:
            out = {"skipped": self._num_skipped, "retries": self._num_retries}
        out["tls_failures"] = self._tls_log.total
        out.update(self.busy.snapshot())
        return out

    def answered(self, exc: BaseException) -> None:
        """Account for a call the server answered with a refusal or busy (a transfer made
        outside the guard): as the guard's ``ANSWERED`` failure."""
        self._failed(exc, Fault.ANSWERED)

    def probe_failed(self, exc: BaseException) -> None:
        """Account for the start's one read of the server that failed (outside the guard): as
        the guard's last failed attempt of a call."""
        self._failed(exc, request_fault(exc) or Fault.TRANSIENT)

    def retrying(self, exc: BaseException) -> None:
        """Count a failed attempt that is tried again (``retries``)."""
        if isinstance(exc, _TLS_ERRORS):
            self._tls_failed(exc)
        with self._lock:
            self._num_retries += 1

    def _failed(self, exc: BaseException, fault: Fault) -> None:
        """Count a call that failed for good (the guard told the breaker)."""
        if isinstance(exc, ServerBusyError):  # not an error: hold calls for a while
            self.busy.note(exc)
            logger.debug("cachetier server is busy: %s", self.describe(exc))
            return
        self._stats.add(errors=1)
        if fault is Fault.ANSWERED:  # the server is up; it said no
            self._on_refused()
            logger.warning("cachetier server refused a request: %s", self.describe(exc))
            return
        if isinstance(exc, _TLS_ERRORS):
            self._tls_failed(exc)
        else:
            self._down_log.failed(self.describe(exc))
        logger.debug("cachetier server call failed: %s", self.describe(exc))

    def _tls_failed(self, exc: BaseException) -> None:
        """Count a failed TLS handshake; warn once per ``TLS_LOG_INTERVAL_S``."""
        count = self._tls_log.note()
        if count is not None:
            logger.warning(
                "TLS with the cachetier server at %s failed (%s): %d time(s) since the last "
                "warning; check ca_file and that the certificate names the url's host",
                redact(self._config.base_url),
                self.describe(exc),
                count,
            )
