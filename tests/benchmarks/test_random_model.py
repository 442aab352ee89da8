"""benchmarks.support.random_model: another model's shapes and tokenizer files, random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks.support.random_model import make_random_model
from cachetier.engine.llm import LLM
from cachetier.engine.model_spec import ModelSpec
from cachetier.engine.sampling import SamplingParams
from tests.models import make_tiny_llama


def test_the_copy_has_the_shapes_and_files_but_not_the_weights(tmp_path: Path) -> None:
    like = make_tiny_llama(tmp_path / "like", tie_word_embeddings=True)
    (like / "README.md").write_text("a model card")
    out = make_random_model(like, tmp_path / "out", seed=3)
    assert (out / "README.md").read_text() == "a model card"
    assert ModelSpec.from_folder(out) == ModelSpec.from_folder(like)
    want, got = load_file(like / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape
        assert not got[name].equal(tensor) or tensor.ndim == 1  # norms start at one in both
    again = make_random_model(like, tmp_path / "again", seed=3)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    with LLM(out, block_size=16) as llm:
        tokens = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3))
    assert len(tokens[0].token_ids) == 3


def test_bad_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        make_random_model(tmp_path, tmp_path / "out")
    like = make_tiny_llama(tmp_path / "like")
    with pytest.raises(ValueError, match="another folder"):
        make_random_model(like, like)
    out = make_random_model(like, tmp_path / "out")
    with pytest.raises(ValueError, match="already holds weights"):
        make_random_model(like, out)
