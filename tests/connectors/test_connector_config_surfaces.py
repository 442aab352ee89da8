"""One store setting, every surface: a TOML file, ``CACHETIER_*`` variables and flags of
``cachetier serve``, vLLM's ``kv_connector_extra_config``, SGLang's and LMCache's extra config
all reach the same ``StoreConfig`` by the same names, and refuse an unknown key or a value that
does not parse with an error that names the key as written there."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachetier.cli.main import build_parser, serve_config
from cachetier.connectors.config import ConnectorConfig, plugin_config
from cachetier.connectors.vllm.launch import kv_transfer_config
from cachetier.server.config import load_config
from cachetier.store.config import StoreConfig

# What every surface sets, and what the store must then hold.
WANT = {"redis_timeout_s": 4.5, "fsync": False, "write_queue_blocks": 7, "disk_file_mode": 0o640}
TEXT = {
    "redis_timeout_s": "4.5",
    "fsync": "false",
    "write_queue_blocks": "7",
    "disk_file_mode": "0640",
}
LMCACHE_SOURCE = "LMCache's extra_config (cachetier.*)"  # cachetier.connectors.lmcache.backend


@pytest.fixture(autouse=True)
def _no_cachetier_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cachetier serve`` reads the process environment: only what a test sets counts."""
    for name in [n for n in os.environ if n.startswith("CACHETIER_")]:
        monkeypatch.delenv(name)


def _toml(tmp_path: Path, settings: dict[str, str]) -> StoreConfig:
    path = tmp_path / "server.toml"
    lines = [f"{name} = {value}" for name, value in settings.items()]
    path.write_text("\n".join(["open_mode = true", *lines]) + "\n")
    return load_config(path, {}).store


def _env(tmp_path: Path, settings: dict[str, str]) -> StoreConfig:
    env = {f"CACHETIER_{name.upper()}": value for name, value in settings.items()}
    return load_config(None, {**env, "CACHETIER_OPEN_MODE": "on"}).store


def _flags(tmp_path: Path, settings: dict[str, str]) -> StoreConfig:
    argv = ["serve", "--open"]
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value in ("true", "false"):  # booleans are --x / --no-x
            argv.append(flag if value == "true" else flag.replace("--", "--no-", 1))
        else:
            argv += [flag, value]
    return serve_config(build_parser().parse_args(argv)).store


def _vllm(tmp_path: Path, settings: dict[str, Any]) -> StoreConfig:
    # What vLLM hands the connector: the dict of kv_transfer_config, through its JSON flag.
    extra = json.loads(json.dumps(kv_transfer_config(settings)))["kv_connector_extra_config"]
    return ConnectorConfig.from_extra_config(extra).store


def _lmcache(tmp_path: Path, settings: dict[str, Any]) -> StoreConfig:
    # LMCache's plugin takes its keys as cachetier.<name> (the real plugin: test_lmcache_plugin).
    extra = {f"cachetier.{name}": value for name, value in settings.items()}
    own = {k.removeprefix("cachetier."): v for k, v in extra.items()}
    return plugin_config(own, {}, source=LMCACHE_SOURCE).store


def _sglang(tmp_path: Path, settings: dict[str, Any]) -> StoreConfig:
    storage = pytest.importorskip("cachetier.connectors.sglang.storage")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=None,
        extra_config={
            "backend_name": "cachetier",
            "model_fingerprint": "surfaces-test-model",
            "disk_path": str(tmp_path / "kv"),
            **settings,
        },
    )
    backend = storage.CacheTierStorage(config)  # the real plugin, as SGLang's factory makes it
    try:
        return backend.config.store
    finally:
        backend.close()


SERVER_SURFACES: dict[str, Callable[[Path, dict], StoreConfig]] = {
    "toml": _toml,
    "env": _env,
    "flags": _flags,
}
PLUGIN_SURFACES: dict[str, Callable[[Path, dict], StoreConfig]] = {
    "vllm": _vllm,
    "lmcache": _lmcache,
    "sglang": _sglang,
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "0o640" if value == 0o640 else str(value)


ALL_SURFACES = [*SERVER_SURFACES, *PLUGIN_SURFACES]


@pytest.mark.parametrize("surface", ALL_SURFACES)
def test_a_store_setting_reaches_the_store_the_same_way_from_every_surface(
    tmp_path: Path, surface: str
) -> None:
    if surface == "toml":
        store = _toml(tmp_path, {k: _toml_value(v) for k, v in WANT.items()})
    elif surface in SERVER_SURFACES:
        store = SERVER_SURFACES[surface](tmp_path, TEXT)
    else:
        # Engines hand over JSON values, or text (a YAML string, an env-expanded value).
        store = PLUGIN_SURFACES[surface](tmp_path, WANT)
        assert PLUGIN_SURFACES[surface](tmp_path, TEXT) == store
    assert {name: getattr(store, name) for name in WANT} == WANT
    assert store == StoreConfig(
        **{**WANT, "disk_path": store.disk_path, "pin_file": store.pin_file}
    )


def spelled(surface: str, name: str) -> str:
    """How a surface's errors spell the key ``name``."""
    return {
        "toml": name,
        "env": f"environment: CACHETIER_{name.upper()}",
        "flags": "command line: --" + name.replace("_", "-"),
        "vllm": f"kv_connector_extra_config: {name}",
        "lmcache": f"{LMCACHE_SOURCE}: {name}",
        "sglang": f"--hicache-storage-backend-extra-config: {name}",
    }[surface]


# --fsync and --no-fsync take no value: a flag cannot give a bad boolean.
@pytest.mark.parametrize("surface", [s for s in ALL_SURFACES if s != "flags"])
def test_a_bad_boolean_is_an_error_naming_the_key(tmp_path: Path, surface: str) -> None:
    make = {**SERVER_SURFACES, **PLUGIN_SURFACES}[surface]
    value = '"ture"' if surface == "toml" else "ture"
    with pytest.raises(ValueError, match="not a boolean") as refused:
        make(tmp_path, {"fsync": value})
    assert f"{spelled(surface, 'fsync')}='ture'" in str(refused.value)


@pytest.mark.parametrize("surface", ALL_SURFACES)
def test_a_bad_number_is_an_error_naming_the_key(tmp_path: Path, surface: str) -> None:
    make = {**SERVER_SURFACES, **PLUGIN_SURFACES}[surface]
    value = '"lots"' if surface == "toml" else "lots"
    with pytest.raises(ValueError, match="is not an integer") as refused:
        make(tmp_path, {"write_queue_blocks": value})
    assert f"{spelled(surface, 'write_queue_blocks')}='lots'" in str(refused.value)


# The environment holds other programs' variables, and argparse refuses unknown flags itself.
@pytest.mark.parametrize("surface", [s for s in ALL_SURFACES if s not in ("env", "flags")])
def test_an_unknown_key_is_an_error_naming_it(tmp_path: Path, surface: str) -> None:
    make = {**SERVER_SURFACES, **PLUGIN_SURFACES}[surface]
    with pytest.raises(ValueError, match=r"unknown .* keys \['redis_timout_s'\]") as refused:
        make(tmp_path, {"redis_timout_s": "4.5"})
    assert "'redis_timout_s' -> 'redis_timeout_s'" in str(refused.value)
