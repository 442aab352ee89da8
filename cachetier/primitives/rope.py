"""A model's rotary embedding settings from its ``config.json``, in either spelling (the old
``rope_theta`` and ``rope_scaling``, or transformers v5's ``rope_parameters``). No torch: the
engine reads a model's spec before anything large is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def rope_settings(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)``: scaling ``None`` for plain RoPE, else a dict with ``rope_type``.

    Raises:
        ValueError: per-layer-type RoPE (``rope_parameters`` without ``rope_theta``).
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        if "rope_theta" not in params:
            raise ValueError(
                "rope_parameters lacks rope_theta (per-layer-type RoPE is not supported)"
            )
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") else {}
        if "type" in scaling:  # the pre-4.45 spelling of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling
