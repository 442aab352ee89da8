"""A model folder's weights as the engine loads them: every tensor by its Hugging Face name."""

from __future__ import annotations

from pathlib import Path

import torch

from cachetier.engine.model_spec import ModelSpec


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
