"""Small random-weight model folders of several attention arrangements, made from a config.

    python -m benchmarks.support.arch_models --kind gemma3 --out DIR [--seed 0]

Each folder holds ``config.json``, ``model.safetensors`` (random weights, float32) and SmolLM2's
tokenizer (the converted folder of ``cachetier.engine.smollm2``), with ``vocab_size`` set to the
tokenizer's. The shapes are tiny (hidden 64, head size 32: the smallest vLLM-CPU's attention
takes, 2-4 layers) and the window is ``WINDOW`` tokens, so that a prompt of a few vLLM-CPU blocks
(32 tokens each) reaches past it. Tokens from random weights mean nothing; what a test may read
off such a folder is whether an engine runs it, and whether two runs of it agree.

Kinds (``KINDS``):

- ``llama``: full attention on every layer.
- ``mistral_sliding``: Mistral, a sliding window on every layer.
- ``qwen2_interleaved``: Qwen2 with ``use_sliding_window`` and ``max_window_layers``: the first
  layers full, the others sliding (transformers runs it; vLLM's Qwen2 refuses a window on some
  layers only).
- ``gemma3``: Gemma-3 (text), local (sliding) and global layers interleaved.
- ``granitemoehybrid``: Granite-4 hybrid, Mamba-2 (recurrent state) layers and attention layers
  (vLLM needs its hybrid KV cache manager for it).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.support.random_model import write_random_weights

WINDOW = 48  # tokens; not a multiple of a 32-token block, so a window starts inside a block
HIDDEN = 64
HEAD_DIM = 32
MAX_POSITIONS = 4096
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _common(vocab_size: int, num_layers: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        # At transformers' default (0.02) these tiny tied-embedding models answer one token
        # over and over, which no comparison of greedy tokens can tell apart; at 0.2 they vary.
        "initializer_range": 0.2,
    }


def _llama(vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(vocab_size, 2))


def _mistral_sliding(vocab_size: int) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(vocab_size, 2), sliding_window=WINDOW)


def _qwen2_interleaved(vocab_size: int) -> Any:
    from transformers import Qwen2Config

    # transformers makes layer i sliding where i >= max_window_layers.
    return Qwen2Config(
        **_common(vocab_size, 4),
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    )


def _gemma3(vocab_size: int) -> Any:
    from transformers import Gemma3TextConfig

    common = _common(vocab_size, 4)
    common.pop("intermediate_size")
    common.pop("initializer_range")
    return Gemma3TextConfig(
        **common,
        intermediate_size=2 * HIDDEN,
        sliding_window=WINDOW,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        query_pre_attn_scalar=HEAD_DIM,
        initializer_range=0.02,  # Gemma's scaled embeddings vary at the default, not at 0.2
    )


def _granitemoehybrid(vocab_size: int) -> Any:
    from transformers import GraniteMoeHybridConfig

    common = _common(vocab_size, 4)
    common.pop("head_dim")  # hidden / heads
    return GraniteMoeHybridConfig(
        **common,
        layer_types=["mamba", "attention", "mamba", "attention"],  # saved as linear/full
        num_local_experts=0,
        shared_intermediate_size=2 * HIDDEN,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        position_embedding_type="rope",
    )


KINDS: dict[str, Callable[[int], Any]] = {
    "llama": _llama,
    "mistral_sliding": _mistral_sliding,
    "qwen2_interleaved": _qwen2_interleaved,
    "gemma3": _gemma3,
    "granitemoehybrid": _granitemoehybrid,
}


def layer_windows(folder: str | Path) -> list[int | None]:
    """Each layer's attention window in tokens, from a folder's ``config.json``: ``None`` for a
    layer that attends to every token before it, or that is no attention layer (recurrent).

    Args:
        folder: a model folder (``make_arch_model``'s, or any with ``num_hidden_layers``).

    Returns:
        One entry per layer, in layer order.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is None:  # Mistral: one window for every layer, if any
        return [window] * config["num_hidden_layers"]
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def record_paths(
    disk: str | Path,
    model: str | Path,
    prompt: list[int],
    grouped: bool,
    record_tokens: int = 16,
) -> dict[str, list[Path]]:
    """Where a disk tier folder keeps each of a prompt's records, per layer set.

    Args:
        disk: the disk tier's folder.
        model: the model folder (fp32 records, its fingerprint, its layer windows).
        prompt: the prompt's token ids.
        grouped: the records of vLLM's hybrid KV cache manager: one layer set for the
            full-attention layers and one for the sliding-window ones, each named by its layer
            indices (``Namespace.layers``; the tiny models have as many of each, so vLLM makes
            one group of each); else one set of every layer, named ``""``.
        record_tokens: tokens per record.

    Returns:
        Per layer set name, the path of each full record of the prompt, in prompt order.
    """
    from cachetier.primitives.fingerprint import model_fingerprint
    from cachetier.primitives.keys import KVLayout, Namespace, block_keys
    from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig

    # From the config, not ModelSpec: Gemma 3 is no architecture of our engine's.
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    windows = layer_windows(model)
    sets = [[i for i, w in enumerate(windows) if (w is None) == full] for full in (True, False)]
    named = {"": len(windows)}
    if grouped and all(sets):
        named = {",".join(map(str, layers)): len(layers) for layers in sets}
    out = {}
    fingerprint = model_fingerprint(model)
    with DiskTier(DiskTierConfig(root=str(disk), capacity_bytes=1 << 40)) as tier:
        for name, num_layers in named.items():
            layout = KVLayout("float32", record_tokens, num_layers, heads, head_dim)
            namespace = Namespace(fingerprint, layout, "", name)
            out[name] = [tier.path_of(namespace.id, key) for key in block_keys(namespace, prompt)]
    return out


def stored_records(
    disk: str | Path, model: str | Path, prompt: list[int], grouped: bool
) -> dict[str, int]:
    """How many of a prompt's records a disk tier folder holds, per layer set
    (``record_paths``' sets)."""
    paths = record_paths(disk, model, prompt, grouped)
    return {name: sum(path.exists() for path in held) for name, held in paths.items()}


def make_arch_model(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight model folder of ``kind`` (``KINDS``) to ``out_dir``.

    Args:
        kind: one of ``KINDS``.
        out_dir: the folder to write (made if missing); it must not hold weights yet.
        seed: seeds the random weights (the same seed gives the same weights).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: an unknown ``kind``, or ``out_dir`` already holds ``model.safetensors``.
    """
    from cachetier.engine.smollm2 import smollm2_path

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; pick one of {sorted(KINDS)}")
    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        raise ValueError(f"{out} already holds model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = smollm2_path()
    for name in _TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    vocab_size = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = KINDS[kind](vocab_size)
    config.dtype = "float32"
    model = write_random_weights(config, out, seed)
    # The architecture is what vLLM picks its model class by; save_pretrained of the model
    # would write it, of a config alone it does not.
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", required=True, choices=sorted(KINDS))
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        print(make_arch_model(args.kind, Path(args.out), args.seed))
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
