"""The live capacity curve of a real sidecar process: its metric families, ``GET /v1/stats``,
``cachetier report --stats URL``, and what other tenants and hostile clients can see or do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachetier.admission import FIXED_POLICIES
from cachetier.record import KVBlock
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.cachetier.admission.curve_traffic import chats, lru_hit_ratio
from tests.server.live import ROOT, TOKENS, ProcessServer, call, call_json, serve_env

BLOCK_BYTES = 1024
CPU_BLOCKS, DISK_BLOCKS = 8, 64
NS = "live-curve"
FACTORS = {"0.5": 0.5, "1": 1.0, "2": 2.0, "4": 4.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessServer]:
    env = serve_env(
        cpu_bytes=CPU_BLOCKS * BLOCK_BYTES, disk_bytes=DISK_BLOCKS * BLOCK_BYTES, live_curve="true"
    )
    data = tmp_path_factory.mktemp("live-curve-sidecar")
    started = ProcessServer(["--data-dir", str(data)], env).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def requests(server: ProcessServer) -> list[list[bytes]]:
    """Chats looked up through a real client, each request's missed blocks put after."""
    sent = chats(120, seed=5)
    tier = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"], timeout_s=30))
    try:
        for keys in sent:
            found = tier.contains_prefix(NS, keys)
            missed = [
                KVBlock(k, b"f" * 32, "uint8", (BLOCK_BYTES,), 16, bytes(BLOCK_BYTES))
                for k in keys[found:]
            ]
            if missed:
                assert tier.put_many(NS, missed) == len(missed)
    finally:
        tier.close()
    return sent


def metrics(server: ProcessServer) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    status, _, body = call(server.url, "GET", "/metrics", token=TOKENS["ops"])
    assert status == 200
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(body.decode())
    }


def test_the_metric_is_the_exact_lru_curve_of_the_lookups(
    server: ProcessServer, requests: list[list[bytes]]
) -> None:
    # Each put stores the missed tail a lookup stored already: the order stays the lookups'.
    counted = requests
    families = metrics(server)
    curve = families["cachetier_tier_hit_ratio_at_capacity"]
    assert {dict(labels)["tier"] for labels in curve} == {"cpu", "disk"}
    for tier, blocks in (("cpu", CPU_BLOCKS), ("disk", DISK_BLOCKS)):
        for label, factor in FACTORS.items():
            want = lru_hit_ratio(counted, round(factor * blocks))
            got = curve[(("capacity_factor", label), ("tier", tier))]
            assert got == pytest.approx(want, abs=1e-9), (tier, label)
    choice = families["cachetier_admission_choice"]
    # The sidecar's disk under the default adaptive policy: exactly one policy chosen.
    disk = {dict(labels)["policy"]: v for labels, v in choice.items() if ("tier", "disk") in labels}
    assert set(disk) == set(FIXED_POLICIES) and sorted(disk.values()) == [0.0, 0.0, 1.0]


def test_stats_carry_the_curve_for_admins_only(
    server: ProcessServer, requests: list[list[bytes]]
) -> None:
    status, stats = call_json(server.url, "GET", "/v1/stats", token=TOKENS["ops"])
    assert status == 200
    assert stats["live_curve"]["disk"]["num_lookups"] == len(requests)
    assert stats["live_curve"]["disk"]["capacity_blocks"] == DISK_BLOCKS
    assert set(stats["admission"]["choices"]) == {"disk"}
    # Another tenant's traffic shapes the curve: a tenant that is not an admin sees none of it.
    status, mine = call_json(server.url, "GET", "/v1/stats", token=TOKENS["bob"])
    assert status == 200 and mine.get("live_curve") is None and mine.get("admission") is None
    assert call(server.url, "GET", "/metrics", token=TOKENS["bob"])[0] == 403
    assert call(server.url, "GET", "/metrics")[0] == 401


def test_hostile_lookups_get_a_4xx_and_leave_the_curve_alone(
    server: ProcessServer, requests: list[list[bytes]]
) -> None:
    before = call_json(server.url, "GET", "/v1/stats", token=TOKENS["ops"])[1]["live_curve"]
    path = f"/v1/namespaces/{NS}/lookup"
    bodies = [
        {"keys": ["00" * 15]},  # a key too short
        {"keys": ["zz" * 32]},  # not hex
        {"keys": "00" * 32},  # not a list
        {"keys": [["00" * 32]]},  # nested
        {"keys": ["00" * 32] * 100_000},  # far past max_keys
    ]
    for body in bodies:
        data = json.dumps(body).encode()
        status, _, _ = call(
            server.url, "POST", path, data, token=TOKENS["alice"], content_type="application/json"
        )
        assert 400 <= status < 500, (body if len(str(body)) < 200 else "many keys", status)
    after = call_json(server.url, "GET", "/v1/stats", token=TOKENS["ops"])[1]["live_curve"]
    assert after == before
    assert metrics(server)["cachetier_tier_hit_ratio_at_capacity"]  # still answers


def test_report_stats_prints_the_curve(
    server: ProcessServer, requests: list[list[bytes]], tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CACHETIER_REMOTE_TOKEN": TOKENS["ops"]}
    argv = [sys.executable, "-m", "cachetier.cli.main", "report", "--stats", server.url]
    argv += ["--out", str(tmp_path / "report.html"), "--json-out", str(out), "--quiet"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "what more capacity would buy" in done.stdout
    figure = json.loads(out.read_text())["figures"]["live_curve"]
    stats = call_json(server.url, "GET", "/v1/stats", token=TOKENS["ops"])[1]["live_curve"]
    rows = {row[0]: row for row in figure["rows"]}
    assert set(rows) == {"cpu", "disk"}
    for tier, row in rows.items():
        assert row[1] == stats[tier]["capacity_blocks"]
        assert row[4:] == [pytest.approx(stats[tier]["hit_ratio"][f]) for f in FACTORS]
        line = f"{tier:<10}{row[1]:>10,}" + "".join(f"{v:>9.4f}" for v in row[4:])
        assert line in done.stdout
    assert "what more capacity" in (tmp_path / "report.html").read_text().lower()
