"""The fault suite's figures: runs ``pytest tests/faults`` and prints what its tests counted.

Every test under ``tests/faults`` injects a real fault (SIGKILL of a writer and of the server,
Redis stopped and paused, a full disk, damaged records, fuzzed decoders and endpoints, one
tenant probing another's blocks) and adds what it saw to a shared tally, which the session
writes to a file; this script prints that tally. The pass/fail verdict is pytest's.

    python benchmarks/bench_faults.py --json

Last line: ``kill_rounds``, ``acknowledged_lost`` (must be 0), ``corrupt_served`` (must be 0),
``redis_outage_requests_failed`` (must be 0), ``fuzz_inputs``, ``fuzz_crashes`` (must be 0),
``cross_tenant_reads`` (must be 0), ``secrets_printed`` (must be 0), ``recovery_s_100k_blocks``,
``hostile_inputs``, ``hostile_5xx``, ``decompressed_over_limit_accepted`` and
``authenticated_clients_refused_during_flood`` (must be 0), ``unauthenticated_body_bytes_read_max``
(at most 65,536), ``slow_client_max_open_s`` (at most ``slow_client_deadline_s`` + 1),
``shared_folder_writes_failed`` and ``shared_folder_blocks_lost`` (4 writers and 2 re-openers
on one disk folder; must be 0), ``shared_folder_peak_bytes_over_capacity`` (at most
``shared_folder_batch_bytes``), and ``tests_passed``.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit  # noqa: E402

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
)
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
            cwd=ROOT,
            env=env,
        )
        elapsed = time.perf_counter() - start
        figures = json.loads(report.read_text()) if report.is_file() else {}
    result: dict[str, object] = {name: figures.get(name, 0) for name in REPORTED}
    result.update({k: v for k, v in figures.items() if k not in result})
    result["tests_passed"] = done.returncode == 0
    result["suite_s"] = round(elapsed, 1)
    result["zeros_held"] = all(result[name] == 0 for name in MUST_BE_ZERO)
    emit(result, args.json)
    sys.exit(0 if done.returncode == 0 and result["zeros_held"] else 1)


if __name__ == "__main__":
    main()
