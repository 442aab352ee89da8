"""Reading a report's inputs; every problem becomes a ``ValueError`` of one line naming the file.

The command turns those into exit status 2, so a missing or corrupt input never ends in a
traceback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from cachetier.report.events import LookupEvent, read_events
from cachetier.report.replay import BLOCK_SIZE as TRACE_BLOCK_SIZE
from cachetier.report.replay import ReplayTrace
from cachetier.util.sidecar_http import call_sidecar

log = logging.getLogger(__name__)


def load_trace(path: str, block_size: int = TRACE_BLOCK_SIZE) -> ReplayTrace:
    """Read and key a Mooncake-format trace.

    Args:
        path: the ``.jsonl`` file.
        block_size: tokens per hash id.

    Returns:
        The keyed trace, ready to replay.

    Raises:
        ValueError: unreadable, not a trace (the message names the line), or empty.
    """
    try:
        trace = ReplayTrace.load(path, block_size=block_size)
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file, so not a Mooncake .jsonl trace") from None
    if not trace.requests:
        raise ValueError(f"{path}: no requests in the trace")
    return trace


def load_events(path: str) -> list[LookupEvent]:
    """Read an event log, forgiving a last line a crash cut short.

    Args:
        path: a file written by ``cachetier.report.events.EventLog``.

    Returns:
        The events, in file order.

    Raises:
        ValueError: unreadable, empty, or a whole line that is not an event (the message
            names it).
    """
    try:
        events = list(read_events(path, strict=True, allow_torn_tail=True))
    except OSError as exc:
        raise ValueError(f"cannot read event log {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file, so not an event log") from None
    if not events:
        raise ValueError(f"{path}: no lookup events in the event log")
    return events


def load_stats(source: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Read tier counters from a file or from a running server.

    Args:
        source: a JSON file (a ``GET /v1/stats`` body or a ``TieredStore.stats()`` dump), or a
            server's base URL ``http(s)://host:port`` (its ``/v1/stats`` is fetched, with the
            bearer token in ``$CACHETIER_REMOTE_TOKEN`` if set; per-tier counters need an
            admin tenant's token).
        timeout_s: seconds to wait for the server.

    Returns:
        The JSON object.

    Raises:
        ValueError: unreadable, unreachable, refused, or not a JSON object.
    """
    if source.startswith(("http://", "https://")):
        url = source.rstrip("/")
        url = url if url.endswith("/v1/stats") else url + "/v1/stats"
        status, answer = call_sidecar(url, "GET", timeout_s=timeout_s)
        if status == 0:
            raise ValueError(f"cannot reach {url}: {answer}")
        if status != 200:
            message = answer.get("message", answer) if isinstance(answer, dict) else answer
            raise ValueError(f"{url}: HTTP {status} {message}")
        if not isinstance(answer, dict):
            raise ValueError(f"{source}: stats must be a JSON object, got {type(answer).__name__}")
        return answer
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read stats {source}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{source}: not a text file, so not stats JSON") from None
    try:
        stats = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: stats are not valid JSON ({exc.msg})") from None
    if not isinstance(stats, dict):
        raise ValueError(f"{source}: stats must be a JSON object, got {type(stats).__name__}")
    return stats
