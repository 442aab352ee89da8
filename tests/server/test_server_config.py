"""Loading the server's config: file, environment, explicit values, in that order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachetier.server.config import ServerConfig, load_config
from tests.server.live import TOKENS

ALICE, BOB = TOKENS["alice"], TOKENS["bob"]


def test_file_then_environment_then_explicit_values(tmp_path: Path) -> None:
    path = tmp_path / "server.json"
    path.write_text(
        json.dumps(
            {
                "port": 9000,
                "cpu_bytes": 1 << 20,
                "tenants": {"alice": [ALICE]},
                "admin_tenants": ["alice"],
            }
        )
    )
    env = {"CACHETIER_CPU_BYTES": str(2 << 20), "CACHETIER_FSYNC": "false"}
    config = load_config(path, env, port=9100, host=None)
    assert (config.port, config.store.cpu_bytes, config.store.fsync, config.host) == (
        9100,
        2 << 20,
        False,
        "127.0.0.1",
    )
    assert config.tenants == {"alice": (ALICE,)} and config.admin_tenants == ("alice",)
    env = {"CACHETIER_TENANTS": f"bob:{BOB}", "CACHETIER_ADMIN_TENANTS": ""}
    assert load_config(path, env).tenants == {"bob": (BOB,)}


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(
        f'open_mode = true\nredis_url = "redis://127.0.0.1:6379/0"\n[tenants]\nbob = "{BOB}"\n'
    )
    config = load_config(path, {})
    assert config.open_mode and config.tenants == {"bob": (BOB,)}
    assert config.store.redis_url == "redis://127.0.0.1:6379/0"
    assert config.store.redis_timeout_s == 0.5


def test_redis_timeout_reaches_the_redis_tier(tmp_path: Path) -> None:
    # A Redis across a thin link needs a longer read timeout than the default (see
    # tests/cachetier/test_redis_tier.py): the server takes it from its file or environment.
    from cachetier.store.config import build_tiers

    path = tmp_path / "server.toml"
    path.write_text('open_mode = true\nredis_url = "redis://127.0.0.1:6379/0"\n')
    config = load_config(path, {"CACHETIER_REDIS_TIMEOUT_S": "4.5"})
    assert config.store.redis_timeout_s == 4.5
    (redis_tier,) = [t for t in build_tiers(config.store) if t.name == "redis"]
    try:
        assert redis_tier.config.socket_timeout_s == 4.5
    finally:
        redis_tier.close()
    with pytest.raises(ValueError, match="redis_timeout_s"):
        load_config(path, {"CACHETIER_REDIS_TIMEOUT_S": "0"})


def test_disk_permissions_for_pods_sharing_a_folder(tmp_path: Path) -> None:
    # One host folder shared by the pods of one group: TOML octal in the file, octal digits in
    # the environment, and both reach the disk tier.
    path = tmp_path / "server.toml"
    path.write_text(f'disk_file_mode = 0o640\n[tenants]\nbob = "{BOB}"\n')
    store = load_config(path, {}).store
    assert (store.disk_file_mode, store.disk_dir_mode) == (0o640, 0o700)
    env = {"CACHETIER_DISK_DIR_MODE": "0750"}
    assert load_config(path, env).store.disk_dir_mode == 0o750
    with pytest.raises(ValueError, match="disk_file_mode"):
        load_config(path, {"CACHETIER_DISK_FILE_MODE": "0400"})


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"prot": 1}', r"unknown config file .* keys \['prot'\]"),
        ('{"port": 70000, "open_mode": true}', "port"),
        ('{"open_mode": true, "max_batch_bytes": 1, "max_block_bytes": 2}', "max_batch_bytes"),
        ('{"open_mode": true, "redis_url": "http://x"}', "redis"),
        ('{"open_mode": true, "cpu_bytes": 0, "disk_bytes": 0}', "at least one tier"),
        ("[1, 2]", "table of settings"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "server.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(path, {})


def test_environment_values_are_checked() -> None:
    with pytest.raises(ValueError, match="CACHETIER_PORT"):
        load_config(env={"CACHETIER_PORT": "eighty", "CACHETIER_OPEN_MODE": "1"})
    with pytest.raises(ValueError, match="tenant:token"):
        load_config(env={"CACHETIER_TENANTS": "just-a-token-0123456789"})
    with pytest.raises(ValueError, match=".toml or .json"):
        load_config("server.yaml", {})


def test_describe_hides_tokens() -> None:
    config = ServerConfig(tenants={"alice": [ALICE, BOB]})
    shown = json.dumps(config.describe())
    assert ALICE not in shown and BOB not in shown and '"alice": "2 token(s)"' in shown
