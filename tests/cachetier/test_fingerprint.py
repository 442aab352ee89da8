"""``model_fingerprint``: one digest per model, the same in every process, cached per file."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from cachetier.primitives.fingerprint import FINGERPRINT_CACHE_NAME, model_fingerprint
from tests.children import run_python


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(FINGERPRINT_CACHE_NAME))
    return dst


def test_fingerprint_is_stable_across_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    code = """
        import sys
        from cachetier.primitives.fingerprint import model_fingerprint
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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        model_fingerprint(tmp_path)
