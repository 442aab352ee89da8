"""The connectors' config: which keys each surface accepts, what its errors list, and what a
plugin that cannot start says."""

from __future__ import annotations

import ast
import logging

import pytest

from cachetier.connectors.config import (
    ALL_KEYS,
    PLUGIN_KEYS,
    VLLM_KEYS,
    ConnectorConfig,
    fails_on_start_error,
    log_start_failure,
    plugin_config,
)

SOURCE = "LMCache's extra_config (cachetier.*)"


def _listed_keys(message: str) -> set[str]:
    """The keys an unknown-key error lists as accepted."""
    return set(ast.literal_eval(message.split("accepted: ", 1)[1]))


def test_a_plugins_unknown_key_error_lists_only_what_a_plugin_accepts() -> None:
    with pytest.raises(ValueError) as refused:
        plugin_config({"disk_pth": "/tmp/kv"}, {}, source=SOURCE)
    message = str(refused.value)
    assert message.startswith(f"unknown {SOURCE} keys ['disk_pth']")
    assert "'disk_pth' -> 'disk_path'" in message  # the likely fix is named
    assert _listed_keys(message) == PLUGIN_KEYS
    assert "remote_token" not in message  # a plugin refuses it: it comes from the environment
    assert "fail_on_start_error" in PLUGIN_KEYS


def test_vllms_unknown_key_error_lists_only_what_vllm_accepts() -> None:
    with pytest.raises(ValueError) as refused:
        ConnectorConfig.from_extra_config({"disk_pth": "/tmp/kv"})
    message = str(refused.value)
    assert message.startswith("unknown kv_connector_extra_config keys ['disk_pth']")
    assert _listed_keys(message) == VLLM_KEYS
    assert "remote_token" in VLLM_KEYS  # vLLM redacts it where it logs the config
    # vLLM cannot serve without its connector: the setting would promise what it cannot do.
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorConfig.from_extra_config({"disk_path": "/tmp/kv", "fail_on_start_error": False})


@pytest.mark.parametrize("value", ["s3cret-token-0123456789", ""])
def test_a_plugin_refuses_a_secret_in_its_logged_settings(value: str) -> None:
    with pytest.raises(ValueError, match="CACHETIER_REMOTE_TOKEN"):
        plugin_config(
            {"remote_url": "http://127.0.0.1:9", "remote_token": value}, {}, source=SOURCE
        )


def test_a_plugin_takes_its_secret_from_the_environment() -> None:
    config = plugin_config(
        {"remote_url": "http://127.0.0.1:9", "cpu_bytes": 0},
        {"CACHETIER_REMOTE_TOKEN": "from-the-env-0123456789"},
        source=SOURCE,
    )
    assert config.store.remote_token == "from-the-env-0123456789"
    assert set(PLUGIN_KEYS) | {"remote_token"} == ALL_KEYS


@pytest.mark.parametrize(
    "settings,fatal",
    [
        ({}, True),
        ({"fail_on_start_error": "false"}, False),
        ({"fail_on_start_error": False}, False),
        ({"fail_on_start_error": "0"}, False),
        ({"fail_on_start_error": "true"}, True),
        ({"fail_on_start_error": "maybe"}, True),  # not a boolean: the default stays
    ],
)
def test_fail_on_start_error_is_read_alone(settings: dict, fatal: bool) -> None:
    assert fails_on_start_error({"disk_pth": "/tmp/kv", **settings}) is fatal
    if fatal is False:
        parsed = plugin_config({"disk_path": "/tmp/kv", **settings}, {}, source=SOURCE)
        assert parsed.fail_on_start_error is False


def test_a_start_failure_is_logged_at_error_saying_what_the_engine_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = ValueError("unknown keys ['disk_pth']")
    with caplog.at_level(logging.ERROR, logger="cachetier.connectors.config"):
        fatal = log_start_failure(error, engine="SGLang", fatal=True)
        quiet = log_start_failure(error, engine="SGLang", fatal=False)
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    assert [r.getMessage() for r in caplog.records] == [fatal, quiet]
    assert "disk_pth" in fatal and "SGLang is not started" in fatal
    assert "fail_on_start_error: false" in fatal
    assert "disk_pth" in quiet and "SGLang is running WITHOUT cachetier" in quiet
