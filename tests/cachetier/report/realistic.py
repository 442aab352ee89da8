"""Reports made the way an operator makes them, for the browser test and
``benchmarks/ops/report.py``: ``cachetier report`` (the CLI's own ``main``) on

- ``trace``: the first requests of the project's Mooncake conversation trace, spread over four
  tenants, with the tier counters of a live sidecar (``--stats http://...``);
- ``hostile``: an engine-style event log whose tenants (cache salts, which clients choose) are
  named to break a page, ``<script>`` and all, with the same live counters.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cachetier.cli.main import main
from cachetier.primitives.keys import Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.report.events import EventLog, LookupEvent
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from cachetier.util.sidecar_http import TOKEN_ENV
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT

ROOT = Path(__file__).resolve().parents[3]
CONVERSATION_TRACE = ROOT / "workloads" / "mooncake_conversation_trace.jsonl.gz"

HOSTILE_TENANTS = (
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(2)">',
    "<!--<script>",
    '"quoted" & <b>bold</b>',
)
"""Tenant names a client may pick as its cache salt: each must show as text, run nothing."""

HOSTILE_NAME_PLACES = 3
"""Where the page shows a tenant's name as text: its table row, its filter option, its bar."""


def conversation_slice(folder: Path, num_requests: int = 3000) -> Path:
    """The first ``num_requests`` requests of the conversation trace (about 17 minutes of it).

    Args:
        folder: where the ``.jsonl`` goes.
        num_requests: how many requests to keep.

    Returns:
        The trace file.
    """
    path = folder / "conversation-head.jsonl"
    with gzip.open(CONVERSATION_TRACE, "rt") as source, open(path, "w") as out:
        for _, line in zip(range(num_requests), source):
            out.write(line)
    return path


def hostile_event_log(folder: Path, num_lookups: int = 400, seed: int = 0) -> Path:
    """An event log like an engine writes, over ten minutes, tenants named by ``HOSTILE_TENANTS``
    beside ordinary ones (and ``""``, no salt).

    Args:
        folder: where the log goes.
        num_lookups: lookups to log.
        seed: of the random hits.

    Returns:
        The log file.
    """
    rng = random.Random(seed)
    tenants = ("alice", "bob", "", *HOSTILE_TENANTS)
    path = folder / "engine-events.jsonl"
    with EventLog(path) as log:
        for i in range(num_lookups):
            num_tokens = rng.randrange(200, 4000)
            blocks = num_tokens // 16
            hit = rng.randrange(0, blocks + 1) * 16
            pool = min(hit, rng.randrange(0, 20) * 16)
            disk = hit - pool
            log.record(
                LookupEvent(
                    time_s=1_764_000_000.0 + i * 600 / num_lookups,
                    tenant=tenants[i % len(tenants)],
                    num_tokens=num_tokens,
                    hit_tokens={"pool": pool, "disk": disk},
                    block_size=16,
                    num_alignment_lost_tokens=num_tokens % 16 if hit == blocks * 16 else 0,
                    restore_s=disk * 2e-5,
                )
            )
    return path


@contextlib.contextmanager
def live_sidecar(folder: Path) -> Iterator[str]:
    """A real sidecar on 127.0.0.1 whose tenants alice and bob have stored and read blocks; the
    report reads its counters with the admin token (set in the environment meanwhile).

    Args:
        folder: its data folder.

    Yields:
        Its URL.
    """
    server = ThreadServer(test_config(folder)).start()
    before = os.environ.get(TOKEN_ENV)
    try:
        ns = Namespace("report-browser", SMALL_LAYOUT)
        for tenant, num_blocks, num_read in (("alice", 12, 9), ("bob", 6, 2)):
            tokens = np.arange(num_blocks * SMALL_LAYOUT.block_size, dtype=np.int64)
            keys = block_keys(ns, tokens + len(tenant))
            blocks = [
                KVBlock(k, ns.fingerprint, "uint8", (64,), SMALL_LAYOUT.block_size, bytes(64))
                for k in keys
            ]
            config = RemoteTierConfig(url=server.url, token=TOKENS[tenant])
            with RemoteTier(config) as tier:
                tier.put_many(ns.id, blocks)
                tier.get_many(ns.id, keys[:num_read])  # hits
                tier.get_many(ns.id, block_keys(ns, tokens + 1000))  # misses
        os.environ[TOKEN_ENV] = TOKENS["ops"]  # an admin sees every tier and tenant
        yield server.url
    finally:
        if before is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = before
        server.stop()


def write_report(out: Path, *args: str) -> tuple[Path, dict]:
    """Run ``cachetier report`` as the command line does.

    Args:
        out: the folder for ``report.html`` and ``report.json``.
        args: its inputs and settings.

    Returns:
        The page and the report document.

    Raises:
        RuntimeError: the command failed.
    """
    html, doc = out / "report.html", out / "report.json"
    status = main(["report", *args, "--out", str(html), "--json-out", str(doc), "--quiet"])
    if status != 0:
        raise RuntimeError(f"cachetier report {' '.join(args)} exited with {status}")
    return html, json.loads(doc.read_text())


def realistic_reports(folder: Path) -> dict[str, tuple[Path, dict]]:
    """Both reports of this module's docstring.

    Args:
        folder: an empty folder for inputs and outputs.

    Returns:
        ``trace`` and ``hostile``: each page and its report document.
    """
    with live_sidecar(folder / "sidecar") as url:
        trace = conversation_slice(folder)
        events = hostile_event_log(folder)
        return {
            "trace": write_report(
                folder / "trace",
                *("--trace", str(trace), "--tenants", "4", "--stats", url),
                *("--cpu-blocks", "2000", "--disk-blocks", "10000"),
                *("--capacities", "500,1000,5000,20000", "--jobs", "1"),
            ),
            "hostile": write_report(folder / "hostile", "--events", str(events), "--stats", url),
        }
