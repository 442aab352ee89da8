"""The converted SmolLM2-135M folder, and the build-once lock that publishes it atomically."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.smollm2 import (
    DEFAULT_MODEL_CACHE,
    MODEL_CACHE_ENV,
    SMOLLM2_FILES,
    _build_once,
    model_cache_dir,
    smollm2_gguf_path,
    smollm2_path,
)
from cachetier.primitives.fingerprint import model_fingerprint
from tests.children import child_env, python_command, run_python_at_once


def tmp_leftovers(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.tmp-*"))


BUILD_IN_CHILD = """
    import sys, time
    from pathlib import Path
    from cachetier.engine.smollm2 import _build_once

    target, log, seconds = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

    def build(folder):
        with open(log, "a") as f:
            f.write(f"{folder}\\n")
        (folder / "partial").write_text("half")
        time.sleep(seconds)
        (folder / "done").write_text("ok")

    print(_build_once(target, build, lambda p: (p / "done").is_file()))
"""


@pytest.mark.slow(reason="races two fresh Python processes on one build that sleeps before it ends")
def test_build_once_builds_once_across_processes(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "model", tmp_path / "builds.log"
    assert run_python_at_once(BUILD_IN_CHILD, target, log, 1.0) == [str(target)] * 2
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
    for name in SMOLLM2_FILES:  # the weights, config and tokenizer, and the conversion's mark
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
@pytest.mark.slow(reason="loads SmolLM2 from its GGUF and from the converted folder and runs both")
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
@pytest.mark.slow(reason="converts SmolLM2 in two processes at once and fingerprints the result")
def test_smollm2_conversion_is_safe_across_processes(smollm2_dir: Path, tmp_path: Path) -> None:
    code = """
        import sys
        from cachetier.engine.smollm2 import smollm2_path
        print(smollm2_path(sys.argv[1]))
    """
    converted = tmp_path / "smollm2-135m"
    assert run_python_at_once(code, tmp_path, timeout=600) == [str(converted)] * 2
    assert tmp_leftovers(converted) == []
    # The conversion is deterministic: a second one is the same model, byte for byte.
    assert model_fingerprint(converted) == model_fingerprint(smollm2_dir)
