"""Model folders: the tiny random Llama, ModelSpec, fingerprints, and the converted SmolLM2."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import engine
from engine.fingerprint import FINGERPRINT_CACHE_NAME, model_fingerprint
from engine.loader import (
    DEFAULT_MODEL_CACHE,
    MODEL_CACHE_ENV,
    ModelSpec,
    _build_once,
    load_weights,
    make_tiny_llama,
    model_cache_dir,
    smollm2_gguf_path,
    smollm2_path,
)

REPO_ROOT = Path(engine.__file__).resolve().parents[1]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def python_command(code: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]


def child_env() -> dict[str, str]:
    # The child imports this checkout's packages, never an installed copy, and stays offline.
    return {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO_ROOT)}


def run_python(code: str, *args: str | Path, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; return the last line it printed."""
    done = subprocess.run(
        python_command(code, *args),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(FINGERPRINT_CACHE_NAME))
    return dst


def tmp_leftovers(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.tmp-*"))


def llama_config(**overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


# --- the tiny random Llama ---------------------------------------------------------------


def test_tiny_llama_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = make_tiny_llama(tmp_path / "a", seed=3)
    b = make_tiny_llama(tmp_path / "b", seed=3)
    c = make_tiny_llama(tmp_path / "c", seed=4)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    weights_a, weights_c = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert weights_a.keys() == weights_c.keys()
    for name in weights_a:
        assert not torch.equal(weights_a[name], weights_c[name]), name


def test_tiny_llama_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    make_tiny_llama(tmp_path / "m", seed=0)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_tiny_llama_loads_in_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert model.dtype == torch.float32
    weights = load_weights(tiny_model_dir)
    state = model.state_dict()
    assert weights.keys() == state.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)

    token_ids = torch.tensor([[1, 5, 17, 42, 99, 200, 7]])
    with torch.no_grad():
        logits = model(token_ids).logits  # [batch, tokens, vocab]
        greedy = token_ids
        for _ in range(12):
            next_id = model(greedy).logits[:, -1].argmax(dim=-1, keepdim=True)
            greedy = torch.cat([greedy, next_id], dim=1)
    assert logits.shape == (1, 7, 256)
    assert torch.isfinite(logits).all()
    # Weights scaled to unit activations: greedy decoding does not collapse to one token.
    assert len(set(greedy[0, 7:].tolist())) > 2


def test_tiny_llama_spec_matches_its_arguments(tmp_path: Path) -> None:
    folder = make_tiny_llama(
        tmp_path / "m",
        num_layers=3,
        hidden_size=96,
        num_heads=6,
        num_kv_heads=3,
        vocab_size=300,
        max_position_embeddings=512,
        rope_theta=50000.0,
    )
    assert ModelSpec.from_folder(folder) == ModelSpec(
        architecture="LlamaForCausalLM",
        num_layers=3,
        hidden_size=96,
        intermediate_size=192,
        num_heads=6,
        num_kv_heads=3,
        head_dim=16,
        vocab_size=300,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_tiny_llama_with_tied_embeddings(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    weights = load_weights(folder)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 3}, "multiple of num_heads"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"seed": -1}, "seed must be a non-negative int"),
        ({"eos_token_id": 256}, "below vocab_size"),
    ],
)
def test_make_tiny_llama_rejects_bad_shapes(
    tmp_path: Path, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_llama(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


# --- ModelSpec ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12},
        {"model_type": "bert", "num_hidden_layers": 12},
        llama_config(architectures=["Gemma2ForCausalLM"]),
    ],
)
def test_model_spec_rejects_unknown_architecture(tmp_path: Path, config: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not Llama-family"):
        ModelSpec.from_folder(tmp_path)


def test_model_spec_reads_legacy_llama_config() -> None:
    spec = ModelSpec.from_config(
        llama_config(
            rope_scaling={"type": "linear", "factor": 2.0},
            eos_token_id=[2, 7],
            head_dim=None,
        )
    )
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 2, 16)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert spec.eos_token_ids == (2, 7)
    assert not spec.attention_bias and spec.sliding_window is None


def test_model_spec_reads_v5_rope_parameters() -> None:
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    spec = ModelSpec.from_config(llama_config(rope_theta=None, rope_parameters=llama3))
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {k: v for k, v in llama3.items() if k != "rope_theta"}
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    assert ModelSpec.from_config(llama_config(rope_parameters=plain)).rope_scaling is None


def test_model_spec_reads_qwen2_and_mistral() -> None:
    qwen2 = ModelSpec.from_config(
        llama_config(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            bos_token_id=None,
            use_sliding_window=False,
            sliding_window=4096,
            tie_word_embeddings=True,
        )
    )
    assert qwen2.attention_bias and qwen2.sliding_window is None and qwen2.bos_token_id is None
    assert qwen2.tie_word_embeddings
    mistral = ModelSpec.from_config(
        llama_config(architectures=None, model_type="mistral", sliding_window=4096)
    )
    assert mistral.architecture == "MistralForCausalLM" and mistral.sliding_window == 4096
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelSpec.from_config(
            llama_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True)
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 0}, "head_dim must be a positive int"),
        ({"vocab_size": 2.5}, "vocab_size must be a positive int"),
        ({"rope_theta": -1.0}, "rope_theta must be a positive number"),
        ({"eos_token_ids": (1000,)}, "below vocab_size"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"architecture": "GPT2LMHeadModel"}, "is not Llama-family"),
    ],
)
def test_model_spec_validates_its_fields(change: dict[str, object], message: str) -> None:
    spec = ModelSpec.from_config(llama_config())
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(spec, **change)


def test_model_spec_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelSpec.from_folder(tmp_path)
    config = llama_config()
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        ModelSpec.from_config(config)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelSpec.from_config(llama_config(hidden_act="gelu"))


# --- fingerprints ------------------------------------------------------------------------


def test_fingerprint_is_stable_across_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    code = """
        import sys
        from engine.fingerprint import model_fingerprint
        print(model_fingerprint(sys.argv[1]))
    """
    in_child = run_python(code, folder)
    assert (folder / FINGERPRINT_CACHE_NAME).is_file()
    (folder / FINGERPRINT_CACHE_NAME).unlink()
    here = model_fingerprint(folder)
    assert here == in_child
    assert re.fullmatch("[0-9a-f]{64}", here)
    assert model_fingerprint(tiny_model_dir) == here  # same bytes in another folder


def test_fingerprint_changes_when_one_weight_changes(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    before = model_fingerprint(folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] += 1e-3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    after = model_fingerprint(folder)
    assert after != before
    (folder / FINGERPRINT_CACHE_NAME).unlink()
    assert model_fingerprint(folder) == after  # what was cached is what a fresh hash gives


def test_fingerprint_follows_config_math_not_metadata(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    before = model_fingerprint(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())

    noise = {
        **config,
        "transformers_version": "0.0.1",
        "_name_or_path": "/elsewhere",
        "dtype": "bfloat16",
        "torch_dtype": "float16",
    }
    # Reordered keys and other whitespace are the same config.
    config_path.write_text(json.dumps(dict(reversed(list(noise.items()))), indent=7))
    assert model_fingerprint(folder) == before

    config_path.write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_fingerprint(folder) != before


def test_fingerprint_cache_is_keyed_by_size_and_mtime(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    weights_path = folder / "model.safetensors"
    before = model_fingerprint(folder)
    cache = json.loads((folder / FINGERPRINT_CACHE_NAME).read_text())
    stat = weights_path.stat()
    assert cache["files"]["model.safetensors"]["size"] == stat.st_size
    assert cache["files"]["model.safetensors"]["mtime_ns"] == stat.st_mtime_ns

    # Same size, same mtime, other bytes: the cached digest is trusted (nothing is re-read).
    data = bytearray(weights_path.read_bytes())
    data[-1] ^= 0xFF
    weights_path.write_bytes(bytes(data))
    os.utime(weights_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_fingerprint(folder) == before

    # A new mtime invalidates the entry and the new bytes are hashed.
    os.utime(weights_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = model_fingerprint(folder)
    assert after != before
    (folder / FINGERPRINT_CACHE_NAME).unlink()
    assert model_fingerprint(folder) == after


def test_fingerprint_survives_a_corrupt_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    expected = model_fingerprint(folder)
    (folder / FINGERPRINT_CACHE_NAME).write_text("{not json")
    assert model_fingerprint(folder) == expected
    assert json.loads((folder / FINGERPRINT_CACHE_NAME).read_text())["version"] == 1


def test_fingerprint_rejects_a_folder_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        model_fingerprint(tmp_path)


# --- build once, atomically --------------------------------------------------------------

BUILD_IN_CHILD = """
    import sys, time
    from pathlib import Path
    from engine.loader import _build_once

    target, log, seconds = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

    def build(folder):
        with open(log, "a") as f:
            f.write(f"{folder}\\n")
        (folder / "partial").write_text("half")
        time.sleep(seconds)
        (folder / "done").write_text("ok")

    print(_build_once(target, build, lambda p: (p / "done").is_file()))
"""


def test_build_once_builds_once_across_processes(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "model", tmp_path / "builds.log"
    children = [
        subprocess.Popen(
            python_command(BUILD_IN_CHILD, target, log, 1.0),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
    assert [out.strip() for out, _ in outputs] == [str(target)] * 2
    assert len(log.read_text().splitlines()) == 1
    assert (target / "done").read_text() == "ok"
    assert tmp_leftovers(target) == []


@pytest.mark.faults
def test_killed_build_leaves_no_half_folder(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "model", tmp_path / "builds.log"
    child = subprocess.Popen(
        python_command(BUILD_IN_CHILD, target, log, 600),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=child_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while not any((p / "partial").exists() for p in tmp_leftovers(target)):
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            assert time.monotonic() < deadline, "the child never started building"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stderr:
            child.stderr.close()
    assert not target.exists()
    assert len(tmp_leftovers(target)) == 1  # the dead build's folder, not yet cleaned

    def build(folder: Path) -> None:
        (folder / "done").write_text("ok")

    assert _build_once(target, build, lambda p: (p / "done").is_file()) == target
    assert sorted(p.name for p in target.iterdir()) == ["done"]
    assert tmp_leftovers(target) == []


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "model"

    def build(folder: Path) -> None:
        (folder / "partial").write_text("half")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        _build_once(target, build, lambda p: (p / "done").is_file())
    assert not target.exists()
    assert tmp_leftovers(target) == []


def test_build_once_replaces_an_incomplete_target(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale").write_text("from an older conversion")

    def build(folder: Path) -> None:
        (folder / "done").write_text("ok")

    assert _build_once(target, build, lambda p: (p / "done").is_file()) == target
    assert sorted(p.name for p in target.iterdir()) == ["done"]
    assert tmp_leftovers(target) == []


def test_model_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(MODEL_CACHE_ENV, raising=False)
    assert model_cache_dir() == DEFAULT_MODEL_CACHE.expanduser()
    monkeypatch.setenv(MODEL_CACHE_ENV, "")
    assert model_cache_dir() == DEFAULT_MODEL_CACHE.expanduser()
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "env"))
    assert model_cache_dir() == tmp_path / "env"
    assert model_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.chdir(tmp_path)
    assert model_cache_dir("relative") == tmp_path / "relative"


# --- the real SmolLM2-135M ---------------------------------------------------------------


@pytest.mark.model
def test_smollm2_folder_has_the_expected_model(smollm2_dir: Path) -> None:
    assert smollm2_path() == smollm2_dir  # the second call finds the converted folder
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (smollm2_dir / name).is_file(), name
    spec = ModelSpec.from_folder(smollm2_dir)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (576, 1536, 49152)
    assert spec.tie_word_embeddings and spec.rope_theta == 100000.0 and spec.rope_scaling is None
    assert (spec.bos_token_id, spec.eos_token_ids) == (1, (2,))
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names  # tied: stored once, as the embedding
        assert {f.get_slice(name).get_dtype() for name in names} == {"F32"}
    assert len(names) == 2 + 9 * 30


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_reloads_with_the_gguf_logits(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    token_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        ).eval()
        expected = reference(token_ids).logits
        del reference
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
        assert model.dtype == torch.float32
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        logits = model(token_ids).logits  # [1, tokens, 49152]
        greedy = model.generate(token_ids, max_new_tokens=2, do_sample=False)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected)
    assert tokenizer.decode(greedy[0, token_ids.shape[1] :]).startswith(" Paris")


@pytest.mark.model
def test_smollm2_tokenizer_round_trips_and_has_a_chat_template(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "KV caches persist across restarts: 12,345 blocks, naïve café ünïcode — done.\n"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert token_ids == original.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)

    saved = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == original.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi!<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_conversion_is_safe_across_processes(smollm2_dir: Path, tmp_path: Path) -> None:
    code = """
        import sys
        from engine.loader import smollm2_path
        print(smollm2_path(sys.argv[1]))
    """
    children = [
        subprocess.Popen(
            python_command(code, tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=600) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
    converted = tmp_path / "smollm2-135m"
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [str(converted)] * 2
    assert tmp_leftovers(converted) == []
    # The conversion is deterministic: a second one is the same model, byte for byte.
    assert model_fingerprint(converted) == model_fingerprint(smollm2_dir)
