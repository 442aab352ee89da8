"""Our engine stores sliding-window layers as far as a hit needs them
(``cachetier.primitives.layer_sets``, ``engine.windowed_bridge``): each layer set in records of
its own namespace, a window's set only from the window before the prompt's last whole block
on; a restart restores the same hit from them, a block that holds some layers only is never
shared with a shorter prefix, and a bad window record costs the hit, never the answer. Real
tiny models, a real disk tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.support.arch_models import record_paths
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.store.config import StoreConfig
from tests.models import make_tiny_sliding

WINDOW = 24
BLOCK = 16
INTERLEAVED = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one
# A hit of PROMPT ends at 144 tokens; its next token sees tokens 121..144: blocks 7 and 8.
FIRST_WINDOW_BLOCK = (9 * BLOCK - WINDOW + 1) // BLOCK
SETS = {"mistral": {"": True}, "qwen2": {"0,2": False, "1,3": True}}  # set -> has a window


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {
        "mistral": make_tiny_sliding(root / "mistral", "mistral", sliding_window=WINDOW),
        "qwen2": make_tiny_sliding(
            root / "qwen2", "qwen2", sliding_window=WINDOW, layer_types=INTERLEAVED
        ),
    }


def _config(disk: Path) -> StoreConfig:
    return StoreConfig(cpu_bytes=0, disk_path=str(disk), fsync=False)


def _cold(folder: Path, prompt: list[int]) -> list[int]:
    llm = LLM(folder, enable_prefix_caching=False, kv_cache_bytes=4 << 20)
    return llm.generate([prompt], GREEDY)[0].token_ids


def _held(disk: Path, folder: Path) -> dict[str, list[int]]:
    """Per layer set, the indices of PROMPT's blocks the disk holds."""
    paths = record_paths(disk, folder, PROMPT, grouped=True)
    return {name: [i for i, p in enumerate(held) if p.exists()] for name, held in paths.items()}


def _store(folder: Path, disk: Path, **options: object) -> None:
    with LLM(folder, store=_config(disk), kv_cache_bytes=4 << 20, guard=False, **options) as llm:
        llm.generate([PROMPT], GREEDY)
        # Its plans would recompute a hit's head over blocks that hold some layers only.
        assert llm.engine.stats()["cost_model"]["enabled"] is False


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_a_windows_layers_are_stored_from_the_window_on(
    folders: dict[str, Path], name: str, tmp_path: Path
) -> None:
    _store(folders[name], tmp_path / "disk")
    held = _held(tmp_path / "disk", folders[name])
    assert set(held) == set(SETS[name])
    for set_name, windowed in SETS[name].items():
        first = FIRST_WINDOW_BLOCK if windowed else 0
        assert held[set_name] == list(range(first, 9)), (set_name, held)


def test_windows_start_on_the_blocks_of_the_engines_that_read_them(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    _store(folders["qwen2"], tmp_path / "disk", window_block_tokens=32)
    held = _held(tmp_path / "disk", folders["qwen2"])
    assert held == {"0,2": list(range(9)), "1,3": list(range(6, 9))}
    with pytest.raises(ValueError, match="multiple of block_size"):
        LLM(folders["qwen2"], window_block_tokens=24)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_a_restart_restores_from_the_window_and_shares_no_partial_block(
    folders: dict[str, Path], name: str, tmp_path: Path
) -> None:
    folder, disk = folders[name], tmp_path / "disk"
    longer, shorter = PROMPT + [1, 2, 3], PROMPT[:70] + [4] * 30
    _store(folder, disk)
    with LLM(folder, store=_config(disk), kv_cache_bytes=4 << 20, guard=False) as llm:
        restored = llm.generate([longer], GREEDY)[0]
        # Its first 4 blocks are the restored ones before the window: their window layers
        # were never read, so no pool hit may come of them (nor a tier hit: no window there).
        again = llm.generate([shorter], GREEDY)[0]
    assert restored.cached_tokens_by_source == {"disk": 144}
    assert restored.token_ids == _cold(folder, longer)
    assert again.num_cached_tokens == 0
    assert again.token_ids == _cold(folder, shorter)


def test_a_bad_window_record_costs_the_hit_not_the_answer(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    folder, disk = folders["qwen2"], tmp_path / "disk"
    _store(folder, disk)
    last = record_paths(disk, folder, PROMPT, grouped=True)["1,3"][8]
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the sliding layers' record of block 8
    last.write_bytes(bytes(data))
    with LLM(folder, store=_config(disk), kv_cache_bytes=4 << 20, guard=False) as llm:
        out = llm.generate([PROMPT + [1, 2, 3]], GREEDY)[0]
    assert out.num_cached_tokens == 0  # no end short of it has its window stored
    assert out.token_ids == _cold(folder, PROMPT + [1, 2, 3])
