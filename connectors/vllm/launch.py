"""The one place that spells how to turn the connector on (``LLM(kv_transfer_config=...)``).

No vLLM import: callers pass the dict to ``vllm.LLM`` or ``vllm serve --kv-transfer-config``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from cachetier.connectors.config import VLLM_PLUGIN_KEYS, plugin_config

CONNECTOR_NAME = "CacheTierConnector"
CONNECTOR_MODULE = "cachetier.connectors.vllm.connector"


def kv_transfer_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for ``CacheTierConnector`` with these tiers.

    Args:
        extra_config: ``ConnectorConfig`` settings by name, e.g. ``{"disk_path": "/var/cache/kv"}``;
            checked here so a typo fails before vLLM starts.

    Returns:
        The dict for ``LLM(kv_transfer_config=...)``; ``json.dumps`` of it is the value of
        ``vllm serve --kv-transfer-config``.
    """
    # Checked as the connector will check it, secrets refused: vLLM logs this dict.
    plugin_config(extra_config, {}, source="kv_connector_extra_config", keys=VLLM_PLUGIN_KEYS)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A block that cannot be restored (evicted, corrupt) is recomputed, never an error.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra_config),
    }


def serve_flag(extra_config: Mapping[str, Any]) -> str:
    """The ``--kv-transfer-config`` value for ``vllm serve`` (a JSON object).

    Args:
        extra_config: the connector's settings (``ConnectorConfig`` settings).

    Returns:
        ``kv_transfer_config(extra_config)`` as compact JSON.
    """
    return json.dumps(kv_transfer_config(extra_config), separators=(",", ":"))


def vllm_cpu_env(base: Mapping[str, str], *, pythonpath: str | None = None) -> dict[str, str]:
    """The environment of a child process that runs vLLM on CPU in-process, offline.

    Args:
        base: the environment to start from (e.g. ``os.environ``); its values win except for
            the ones vLLM-CPU needs here.
        pythonpath: a folder to put first on ``PYTHONPATH`` (the repo, for ``connectors``).

    Returns:
        A new dict.
    """
    env = dict(base)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # scheduler and worker in one process
        HF_HUB_OFFLINE="1",  # nothing may be downloaded at run time
        TRANSFORMERS_OFFLINE="1",
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged KV
    # vLLM serves with one torch thread on a small machine; more OpenMP threads than free cores
    # make every op wait on a busy core (decode slows by an order of magnitude).
    env.setdefault("OMP_NUM_THREADS", "1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env
