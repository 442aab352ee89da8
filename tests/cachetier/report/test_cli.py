"""``cachetier report`` end to end: a trace, an event log, stats from a file and from a real
server, and bad inputs (exit status 2 and one line, never a traceback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cachetier.cli.main import main
from cachetier.primitives.keys import Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from cachetier.util.sidecar_http import TOKEN_ENV
from tests.cachetier.report import tiny
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT, write_engine_event_log

ROOT = Path(__file__).resolve().parents[3]


def _report(tmp_path: Path, *args: str) -> tuple[int, dict | None, str]:
    html, out = tmp_path / "out" / "report.html", tmp_path / "out" / "report.json"
    status = main(["report", *args, "--out", str(html), "--json-out", str(out), "--quiet"])
    doc = json.loads(out.read_text()) if status == 0 else None
    return status, doc, html.read_text() if status == 0 else ""


def _embedded(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html)
    assert match, "the page embeds the report document"
    return json.loads(match.group(1).replace("<\\/", "</"))


def assert_self_contained(html: str) -> None:
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html
    assert not re.search(r"<script[^>]*\bsrc=", html)
    sources = re.findall(r'\bsrc="([^"]*)"', html)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)


def test_trace_report_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    status, doc, html = _report(
        tmp_path,
        "--trace",
        str(trace),
        "--cpu-blocks",
        "3",
        "--disk-blocks",
        "100",
        "--capacities",
        "1,2",
        "--tenants",
        "2",
        "--prefill-tokens-per-s",
        "512",
    )
    assert status == 0 and doc is not None
    assert_self_contained(html)
    assert _embedded(html) == doc  # the page carries the same figures as the JSON
    assert set(doc["figures"]) == {
        "hit_rate_over_time",
        "per_tier",
        "per_tenant",
        "saved",
        "alignment",
        "capacity_curve",
        "load_or_recompute",
        "why_missed",
        "admission",
    }
    for name in ("hit_rate_over_time", "per_tier", "capacity_curve", "alignment", "admission"):
        assert f'<section id="{name}">' in html
    head = doc["headline"]
    assert head["num_lookups"] == 6 and head["num_tokens"] == tiny.NUM_TOKENS
    assert head["hit_tokens_by_source"] == {"cpu": 3072, "disk": 1024}
    assert head["alignment_lost_tokens"] == 76 + 2 * 512
    assert head["saved_s"] == pytest.approx(8.0)
    assert head["num_tenants"] <= 2
    assert sum(doc["figures"]["per_tenant"]["num_tokens"]) == tiny.NUM_TOKENS
    assert head["at_capacity"]["100"]["lru"] == pytest.approx(11 / 17)
    assert doc["figures"]["capacity_curve"]["capacities"] == [1, 2, 3, 100]
    out = capsys.readouterr().out
    assert "served from cache  4,096 (55.5%)" in out
    assert "default policy (lru) >= LRU at every capacity: yes" in out
    admission = doc["figures"]["admission"]
    assert admission["policies"] == ["all", "adaptive", "second_hit", "tinylfu"]
    assert admission["capacities"] == [3, 100]  # the curve's, from the CPU tier's up
    assert "admission, over 3 cpu blocks" in out
    assert "disk capacity (blocks)" in html  # its table


def test_admission_replays_can_be_left_out(tmp_path: Path) -> None:
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    status, doc, _ = _report(
        tmp_path, "--trace", str(trace), "--admission-policies", "none", "--capacities", "5"
    )
    assert status == 0 and doc is not None
    assert "admission" not in doc["figures"] and "capacity_curve" in doc["figures"]
    assert doc["settings"]["admission_policies"] == []
    status, doc, _ = _report(
        tmp_path, "--trace", str(trace), "--admission-policies", "tinylfu", "--capacities", "5"
    )
    assert status == 0 and doc is not None
    assert doc["figures"]["admission"]["policies"] == ["all", "tinylfu"]


def test_exact_replays_every_key_and_says_so(tmp_path: Path) -> None:
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    for flags, exact in (((), False), (("--exact",), True)):
        status, doc, _ = _report(tmp_path, "--trace", str(trace), "--capacities", "5", *flags)
        assert status == 0 and doc is not None
        curve = doc["figures"]["capacity_curve"]
        assert doc["settings"]["exact"] is exact and doc["settings"]["max_error"] == 0.005
        assert curve["sample_rate"] == 1.0  # a tiny trace is replayed whole either way
        assert "Every key of the trace is replayed" in curve["how"]


def test_event_log_report_end_to_end(tmp_path: Path) -> None:
    log_path = tmp_path / "events.jsonl"
    write_engine_event_log(log_path, {"pool": 160, "disk": 320})
    with open(log_path, "a") as f:
        f.write('{"time_s": 17')  # a crash mid-line: forgiven
    status, doc, html = _report(tmp_path, "--events", str(log_path), "--prefill-tokens-per-s", "96")
    assert status == 0 and doc is not None
    assert_self_contained(html)
    assert _embedded(html) == doc
    assert "capacity_curve" not in doc["figures"]  # an event log has no keys to replay
    head = doc["headline"]
    assert head["num_lookups"] == 40 and head["hit_tokens"] == 20 * 480
    assert head["hit_tokens_by_source"] == {"pool": 20 * 160, "disk": 20 * 320}
    assert head["net_saved_s"] == pytest.approx(20 * 480 / 96 - 20 * 0.5)
    tenants = doc["figures"]["per_tenant"]
    assert tenants["tenants"] == ["alice", "bob"] and tenants["num_lookups"] == [30, 10]
    # Every 4th lookup is bob's, and each is even: bob never hit.
    assert tenants["hit_tokens"] == [20 * 480, 0]
    assert doc["figures"]["hit_rate_over_time"]["bin_s"] == 10.0  # 585 s in <= 60 bins


def _stats_body() -> dict:
    snapshot = {"hits": 30, "misses": 10, "puts": 5, "hit_rate": 0.75, "used_bytes": 1024}
    return {
        "tenant": "ops",
        "tenants": {"alice": {"hits": 3, "misses": 1, "hit_rate": 0.75}},
        "tiers": {"cpu": snapshot, "disk": {**snapshot, "hits": 1, "hit_rate": 0.09}},
        "pending_writes": {"disk": 0},
    }


def test_stats_file_gives_a_counters_table(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(_stats_body()))
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    status, doc, html = _report(tmp_path, "--trace", str(trace), "--stats", str(stats))
    assert status == 0 and doc is not None
    table = doc["figures"]["tier_counters"]
    rows = {(r[0], r[1]): dict(zip(table["columns"], r)) for r in table["rows"]}
    assert set(rows) == {("tier", "cpu"), ("tier", "disk"), ("tenant", "alice")}
    assert rows[("tier", "disk")]["hits"] == 1 and rows[("tier", "cpu")]["used_bytes"] == 1024
    assert rows[("tenant", "alice")]["evictions"] is None
    assert '<section id="tier_counters">' in html


def test_stats_of_a_live_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ThreadServer(test_config(tmp_path / "server")).start()
    try:
        ns = Namespace("report-test", SMALL_LAYOUT)
        keys = block_keys(ns, np.arange(4 * SMALL_LAYOUT.block_size, dtype=np.int64))
        blocks = [
            KVBlock(k, ns.fingerprint, "uint8", (8,), SMALL_LAYOUT.block_size, bytes(8))
            for k in keys
        ]
        with RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"])) as tier:
            tier.put_many(ns.id, blocks)
            assert tier.get_many(ns.id, keys[:3]) == blocks[:3]
        monkeypatch.setenv(TOKEN_ENV, TOKENS["ops"])  # an admin tenant sees the tiers
        status, doc, _ = _report(tmp_path, "--stats", server.url)
    finally:
        server.stop()
    assert status == 0 and doc is not None
    assert doc["input"]["kind"] == "stats"
    table = doc["figures"]["tier_counters"]
    rows = {(r[0], r[1]): dict(zip(table["columns"], r)) for r in table["rows"]}
    assert ("tier", "cpu") in rows and ("tier", "disk") in rows
    assert rows[("tenant", "alice")]["hits"] == 3
    assert "counters from http://127.0.0.1:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "make,args,message",
    [
        (None, ["--trace", "{tmp}/missing.jsonl"], "cannot read trace .*missing.jsonl"),
        (b"\xff\xfe\x00garbage", ["--trace", "{tmp}/bad"], "not a text file"),
        (b'{"timestamp": 1}\n', ["--trace", "{tmp}/bad"], r"bad:1: missing field"),
        (b"", ["--trace", "{tmp}/bad"], "no requests"),
        (None, ["--events", "{tmp}/missing.jsonl"], "cannot read event log"),
        (b"not json\nnor this\n", ["--events", "{tmp}/bad"], r"bad:1: not a lookup event"),
        (b"\n", ["--events", "{tmp}/bad"], "no lookup events"),
        (b"[1, 2]", ["--stats", "{tmp}/bad"], "stats must be a JSON object"),
        (b'{"a": 1}', ["--stats", "{tmp}/bad"], "no tier counters"),
        (None, ["--stats", "http://127.0.0.1:9/"], "cannot reach http://127.0.0.1:9/v1/stats"),
        (None, [], "nothing to report on"),
        (None, ["--trace", "a", "--events", "b"], "not both"),
        (None, ["--trace", "a", "--policy", "fifo"], "'fifo' is not one of"),
        (None, ["--trace", "a", "--tenants", "0"], "--tenants must be >= 1"),
        (None, ["--trace", "a", "--admission-policies", "lfu"], "admission policy 'lfu'"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: bytes | None,
    args: list[str],
    message: str,
) -> None:
    if make is not None:
        (tmp_path / "bad").write_bytes(make)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    status, _, _ = _report(tmp_path, *args)
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("cachetier report: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "report.html").exists()


def test_the_command_exits_2_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text("{oops\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachetier.cli.main",
            "report",
            "--trace",
            str(tmp_path / "t.jsonl"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr == f"cachetier report: {tmp_path / 't.jsonl'}:1: not valid JSON "
        "(Expecting property name enclosed in double quotes)\n"
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "report.html").exists()


def test_png_out_draws_every_plot_on_one_picture(tmp_path: Path) -> None:
    trace = tiny.write_tiny_trace(tmp_path / "tiny.jsonl")
    png = tmp_path / "docs" / "report.png"
    status, _, _ = _report(tmp_path, "--trace", str(trace), "--png-out", str(png))
    assert status == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_png_out_of_stats_alone_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(_stats_body()))
    status, _, _ = _report(tmp_path, "--stats", str(stats), "--png-out", str(tmp_path / "x.png"))
    assert status == 2 and "--png-out needs --trace or --events" in capsys.readouterr().err
