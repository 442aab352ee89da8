"""The fault suite's figures: runs ``pytest tests/faults`` and prints what its tests counted.

Every test under ``tests/faults`` injects a real fault (SIGKILL of a writer and of the server,
Redis stopped and paused, a full disk, damaged records, fuzzed decoders and endpoints, one
tenant probing another's blocks) and adds what it saw to a shared tally, which the session
writes to a file; this script prints that tally. The pass/fail verdict is pytest's.

    python -m benchmarks.faults --json

Last line: ``kill_rounds``, ``acknowledged_lost`` (must be 0), ``corrupt_served`` (must be 0),
``redis_outage_requests_failed`` (must be 0), ``fuzz_inputs``, ``fuzz_crashes`` (must be 0),
``cross_tenant_reads`` (must be 0), ``secrets_printed`` (must be 0), ``recovery_s_100k_blocks``,
``hostile_inputs``, ``hostile_5xx``, ``decompressed_over_limit_accepted`` and
``authenticated_clients_refused_during_flood`` (must be 0), ``unauthenticated_body_bytes_read_max``
(at most 65,536), ``slow_client_max_open_s`` (at most ``slow_client_deadline_s`` + 1),
``shared_folder_writes_failed`` and ``shared_folder_blocks_lost`` (4 writers and 2 re-openers
on one disk folder; must be 0), ``shared_folder_peak_bytes_over_capacity`` (at most
``shared_folder_batch_bytes``); from connection floods without a token against a real
``cachetier serve`` (``tests/faults/test_floods.py``, with and without TLS):
``fd_flood_listeners_dead`` (listeners, HTTP and transfer, not serving a real request within
5 s of a flood to the descriptor limit ``fd_flood_nofile`` ending; must be 0),
``fd_flood_legit_success_after`` (a real client's gets and puts after it, over the transfer
port and HTTP; must be 1.0), ``fd_flood_peak_fds``, and for ``https_handshake_flood_rounds``
rounds of ``https_handshake_flood_connections`` unfinished TLS handshakes:
``https_handshake_flood_rss_growth_mib`` (at most 256), ``https_handshake_flood_rss_retained_mib``
(read once within 32 of before, or ``https_handshake_flood_retain_wait_s`` on; at most 32) and
``legit_https_success_during_handshake_flood`` (at least 0.99); ``bounds_held`` says whether
every such bound held; ``oversized_heads_accepted`` (heads from just over ``max_head_bytes``
to 256 KiB, in one read, random chunks and 64-byte pieces; must be 0); from tenants sharing
the sidecar (``tests/faults/test_tenant_fairness.py``): ``tenant_slot_starvation`` (a fresh
client's failed gets and puts while another tenant holds every connection it may; must be 0)
and ``noisy_tenant_victim_p99_ratio`` (a tenant's p99 latency while another floods, over its
p99 alone, at default settings; at most 2.0); from the fleet's listeners: the HTTP port's
places by tenant (``http_tenant_starvation``: a fresh tenant's failed requests while another
holds every HTTP connection it may; must be 0), ``pipelined_oversized_heads_accepted`` (must
be 0), ``flood_rss_retained_mib`` (a minute after plain-HTTP floods; at most 32),
``quarantine_cross_tenant_refusals`` (a tenant's reports refused while another fills its
quota; must be 0), ``kv_events_unauthenticated_reads`` (events read without a listed CURVE
key; must be 0), ``replay_clients_rss_growth_mib`` (100 replay clients that never read; at
most 64), ``streams_cut_silently_with_replica_killed`` (of 20 streamed chats through the
router, one replica SIGKILLed; must be 0), ``router_5xx`` (over the router's fuzzing corpus;
must be 0) and ``router_healthz_p99_s_under_big_requests`` (four 4 MiB requests in flight; at
most 0.1); and ``tests_passed``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.support.children import REPO_ROOT
from benchmarks.support.output import emit

MUST_BE_ZERO = (
    "acknowledged_lost",
    "corrupt_served",
    "redis_outage_requests_failed",
    "fuzz_crashes",
    "cross_tenant_reads",
    "secrets_printed",
    "hostile_5xx",
    "decompressed_over_limit_accepted",
    "authenticated_clients_refused_during_flood",
    "shared_folder_writes_failed",
    "shared_folder_blocks_lost",
    "fd_flood_listeners_dead",
    "oversized_heads_accepted",
    "tenant_slot_starvation",
    "http_tenant_starvation",
    "pipelined_oversized_heads_accepted",
    "kv_events_unauthenticated_reads",
    "streams_cut_silently_with_replica_killed",
    "quarantine_cross_tenant_refusals",
    "router_5xx",
)
AT_LEAST = {  # figure -> its floor, checked when the suite reported it
    "fd_flood_legit_success_after": 1.0,
    "legit_https_success_during_handshake_flood": 0.99,
}
AT_MOST = {  # figure -> its ceiling, checked when the suite reported it
    "https_handshake_flood_rss_growth_mib": 256,
    "https_handshake_flood_rss_retained_mib": 32,
    "noisy_tenant_victim_p99_ratio": 2.0,
    "router_healthz_p99_s_under_big_requests": 0.1,
    "replay_clients_rss_growth_mib": 64,
    "flood_rss_retained_mib": 32,
}
REPORTED = (
    "kill_rounds",
    *MUST_BE_ZERO,
    "fuzz_inputs",
    "recovery_s_100k_blocks",
    "hostile_inputs",
    "unauthenticated_body_bytes_read_max",
    "slow_client_max_open_s",
    "slow_client_deadline_s",
    "shared_folder_peak_bytes_over_capacity",
    "shared_folder_batch_bytes",
    "fd_flood_nofile",
    "fd_flood_peak_fds",
    *AT_LEAST,
    "https_handshake_flood_connections",
    "https_handshake_flood_rounds",
    "https_handshake_flood_retain_wait_s",
    *AT_MOST,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k crash)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.json"
        env = {**os.environ, "CACHETIER_FAULTS_REPORT": str(report)}
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "tests/faults", *args.pytest_args],
            cwd=REPO_ROOT,
            env=env,
        )
        elapsed = time.perf_counter() - start
        figures = json.loads(report.read_text()) if report.is_file() else {}
    result: dict[str, object] = {name: figures.get(name, 0) for name in REPORTED}
    result.update({k: v for k, v in figures.items() if k not in result})
    result["tests_passed"] = done.returncode == 0
    result["suite_s"] = round(elapsed, 1)
    result["zeros_held"] = all(result[name] == 0 for name in MUST_BE_ZERO)
    # A figure a run left out (``-k``) is not checked: 0 would fail a floor for no reason.
    result["bounds_held"] = all(
        figures[name] >= floor for name, floor in AT_LEAST.items() if name in figures
    ) and all(figures[name] <= ceiling for name, ceiling in AT_MOST.items() if name in figures)
    emit(result, args.json)
    held = result["zeros_held"] and result["bounds_held"]
    sys.exit(0 if done.returncode == 0 and held else 1)


if __name__ == "__main__":
    main()
