"""cachetier as LMCache 0.5.6's storage plugin, loaded by LMCache's own ``storage_plugins``.

LMCache lives in ``.venv-peers`` (``make setup-peers``: it pulls ~100 packages, kept out of
``.venv``); each test runs a scenario there as a fresh process (``lmcache_child.py``, or the
restart steps of ``benchmarks.plugins.lmcache``) and checks what it printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.children import run_peers

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.slow(reason="runs each scenario in a fresh process that imports LMCache"),
]

CHILD = Path(__file__).with_name("lmcache_child.py")
PLUGINS = "benchmarks.plugins.lmcache"  # a module: run_peers runs it with -m


def test_all_chunks_survive_a_restart_where_lmcaches_own_disk_finds_none(tmp_path: Path) -> None:
    wrote = run_peers(PLUGINS, "--step", "write", "--work", tmp_path, "--chunks", "32")
    assert wrote == {"lmcache_chunks": 32}
    found = run_peers(PLUGINS, "--step", "read", "--work", tmp_path, "--chunks", "32")
    # Every chunk our plugin gives back was compared byte for byte with what was put.
    assert found == {"lmcache_found_after_restart": 32, "lmcache_own_disk_found_after_restart": 0}


def test_models_tenants_and_workers_never_meet(tmp_path: Path) -> None:
    out = run_peers(CHILD, "isolation", tmp_path)
    assert out["same"] == ["same"] * 4
    for name in ("other_model", "other_tenant", "other_worker"):
        assert out[name] == [0, 0], name


def test_redis_behind_the_plugin(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    assert run_peers(CHILD, "redis", tmp_path, redis_url, redis_prefix) == {"found": ["same"] * 4}


def test_a_corrupt_record_is_a_miss_never_wrong_kv(tmp_path: Path) -> None:
    found = run_peers(CHILD, "corrupt", tmp_path)["found"]
    assert sorted(found) == ["miss", "same", "same"]


def test_a_partial_chunk_is_not_stored(tmp_path: Path) -> None:
    assert run_peers(CHILD, "partial", tmp_path) == {"stored": 0, "files": 0}


def test_a_bad_config_stops_lmcache_loudly_unless_told_otherwise(tmp_path: Path) -> None:
    # LMCache's launcher swallows a plugin's exceptions; ours must not be served around.
    out = run_peers(CHILD, "starts", tmp_path)
    causes = {
        "secret": "CACHETIER_REMOTE_TOKEN",
        "typo": "keys ['disk_pth'] (did you mean 'disk_pth' -> 'disk_path'?)",
        "no_fingerprint": "extra_config['cachetier.model_fingerprint']",
    }
    for name, cause in causes.items():
        case = out[name]
        assert case["rc"] == 1 and case["out"] is None, (name, case["stderr"][-2000:])
        errors = [
            line for line in case["stderr"].splitlines() if "cachetier.connectors.config" in line
        ]
        assert len(errors) == 1, (name, case["stderr"][-2000:])
        assert errors[0].startswith("ERROR cachetier.connectors.config: cachetier could not start")
        assert cause in errors[0] and "LMCache is not started" in errors[0], errors[0]
    assert "s3cret" not in out["secret"]["stderr"]
    assert "'remote_token'" not in out["typo"]["stderr"]  # a plugin does not accept it
    quiet = out["typo_not_fatal"]
    assert quiet["rc"] == 0 and quiet["out"]["plugin"] is False, quiet["stderr"][-2000:]
    errors = [
        line for line in quiet["stderr"].splitlines() if "cachetier.connectors.config" in line
    ]
    assert len(errors) == 1 and "LMCache is running WITHOUT cachetier" in errors[0]
    assert out["good"]["rc"] == 0 and out["good"]["out"]["plugin"] is True


def test_a_corrupt_chunk_is_logged_once_and_no_longer_counted(tmp_path: Path) -> None:
    out = run_peers(CHILD, "corrupt_logged", tmp_path)
    assert out["before"] == 3  # not known to be corrupt until a read checks it
    assert sorted(out["found"]) == ["miss", "miss", "same"]
    assert out["after"] == 1  # LMCache's contains asks per key: the good one is still there
    lines = [line for line in out["log"] if "is corrupt" in line]
    assert len(lines) == 1, out["log"]  # the second, within the interval, is only counted
    assert "cachetier disk tier" in lines[0]
    assert any(key in lines[0] for key in out["tampered"]), (lines, out["tampered"])
