"""cachetier as LMCache 0.5.6's storage plugin, loaded by LMCache's own ``storage_plugins``.

LMCache lives in ``.venv-peers`` (``make setup-peers``: it pulls ~100 packages, kept out of
``.venv``); each test runs a scenario there as a fresh process (``lmcache_child.py``, or the
restart steps of ``benchmarks/plugins_lmcache.py``) and checks what it printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.children import REPO_ROOT, run_peers

pytestmark = [pytest.mark.lmcache, pytest.mark.slow]

CHILD = Path(__file__).with_name("lmcache_child.py")
PLUGINS = REPO_ROOT / "benchmarks" / "plugins_lmcache.py"


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
