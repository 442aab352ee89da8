"""A bad ``kv_connector_extra_config`` stops vLLM's connector at start, loudly: real vLLM config
objects, the connector built as vLLM builds it (no model is loaded: the config is checked
first)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402

from cachetier.connectors.vllm.connector import CacheTierConnector  # noqa: E402


def _config(extra: dict) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="CacheTierConnector",
            kv_connector_module_path="cachetier.connectors.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    )


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize(
    "extra,cause",
    [
        ({"disk_pth": "/tmp/kv"}, "keys ['disk_pth'] (did you mean 'disk_pth' -> 'disk_path'?)"),
        ({"disk_path": "/tmp/kv", "fail_on_start_error": False}, "['fail_on_start_error']"),
        ({"disk_path": "/tmp/kv", "compression": "zstd"}, "compression"),
    ],
)
def test_a_bad_config_is_refused_loudly(
    caplog: pytest.LogCaptureFixture, role: KVConnectorRole, extra: dict, cause: str
) -> None:
    kv_cache_config = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError) as refused:
        CacheTierConnector(_config(extra), role, kv_cache_config)
    assert cause in str(refused.value)
    if "unknown" in str(refused.value):
        assert "fail_on_start_error" not in str(refused.value).split("accepted: ")[1]
    errors = [r for r in caplog.records if r.name == "vllm.cachetier.connector"]
    assert len(errors) == 1
    assert cause in errors[0].getMessage()
    assert "vLLM does not start without it" in errors[0].getMessage()
