"""``cachetier quarantine list`` and ``lift`` against a live sidecar, as an operator runs them."""

from __future__ import annotations

import os
import subprocess
import sys

from cachetier.primitives.keys import Namespace
from tests.server.live import TOKENS, ThreadServer, call_json


def _cli(*args: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CACHETIER_REMOTE_TOKEN"}
    if token is not None:
        env["CACHETIER_REMOTE_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "cachetier.cli", "quarantine", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_operator_lists_and_lifts_a_quarantine(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    url = shared_server.url
    report = {"namespace": own_namespace.id, "reason": "layer 3 V differs"}
    assert call_json(url, "POST", "/v1/quarantines", report, token=TOKENS["alice"])[0] == 200
    listed = _cli("list", "--url", url, token=TOKENS["ops"])
    assert listed.returncode == 0, listed.stderr
    mine = [line for line in listed.stdout.splitlines() if own_namespace.id in line]
    assert len(mine) == 2 and all("layer 3 V differs" in line for line in mine)
    assert TOKENS["ops"] not in listed.stdout + listed.stderr
    # A tenant's token may list its own, not lift.
    refused = _cli("lift", "--url", url, "--namespace", own_namespace.id, token=TOKENS["alice"])
    assert refused.returncode == 1 and "403" in refused.stderr
    lifted = _cli(
        "lift",
        "--url",
        url,
        "--namespace",
        own_namespace.id,
        "--tenant",
        "alice",
        token=TOKENS["ops"],
    )
    assert lifted.returncode == 0 and "lifted 2 quarantine(s): cpu, disk" in lifted.stdout
    again = _cli("list", "--url", url, token=TOKENS["alice"])
    assert own_namespace.id not in again.stdout


def test_an_unreachable_sidecar_or_no_token_is_a_clear_failure(shared_server: ThreadServer) -> None:
    no_token = _cli("list", "--url", shared_server.url, token=None)
    assert no_token.returncode == 1 and "401" in no_token.stderr
    bad = _cli("lift", "--url", shared_server.url, token=TOKENS["ops"])
    assert bad.returncode == 2 and "--namespace" in bad.stderr
