"""Model folders for the engine tests: a tiny random Llama (instant) and the real SmolLM2-135M."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.loader import make_tiny_llama, smollm2_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocab 256, 4 heads, 2 KV heads, head_dim 16), seed 0.

    Shared by the whole session: a test that changes files must copy the folder first.
    """
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, ~30 s, then cached
    under ``$CACHETIER_MODEL_CACHE`` or ``~/.cache/cachetier/models``)."""
    return smollm2_path()
