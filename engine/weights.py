"""A model folder's weights as the engine loads them: every tensor by its Hugging Face name."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cachetier.engine.config import EngineConfig
from cachetier.engine.model_spec import ModelSpec
from cachetier.guard.first_layer import FirstLayer
from cachetier.guard.record_check import RecordCheck


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's ``*.safetensors`` files by its Hugging Face name.

    A tied model stores only ``model.embed_tokens.weight``; ``lm_head.weight`` is then the same
    tensor, as transformers makes it.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ValueError(f"{folder} has no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        weights.update(load_file(path))
    if "lm_head.weight" not in weights and ModelSpec.from_folder(folder).tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def record_check_of(
    folder: str | Path, weights: dict[str, torch.Tensor], config: EngineConfig
) -> RecordCheck | None:
    """The check of every restored record (``cachetier.guard.record_check``), over the
    engine's own first-layer tensors; ``None`` where ``config.record_check`` is off."""
    if not config.record_check:
        return None
    model_config = json.loads((Path(folder) / "config.json").read_text())
    layer = FirstLayer.from_tensors(model_config, weights.get)
    return RecordCheck(layer, config.record_check_tokens)
