"""What cachetier installs is importable under ``cachetier`` only, so it sits beside packages
whose names its folders share: Hugging Face's kernel hub is ``kernels``, which transformers
looks up with ``find_spec("kernels")``.

``make setup`` puts the hub's ``kernels`` in ``.venv/hf-kernels`` (outside the venv's own
packages: run from a checkout, the repository's ``kernels/`` folder would shadow it there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.deploy.server_env import copied_parts

ROOT = Path(__file__).resolve().parents[1]
HF_KERNELS = Path(sys.prefix) / "hf-kernels"

# Run in a folder of its own, so that no checkout is on sys.path: what imports is what an
# installed cachetier gives.
CHECK_BOTH = """
import importlib.util, sys
import kernels, cachetier.kernels
assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__
assert cachetier.kernels.__file__.startswith(sys.argv[2]), cachetier.kernels.__file__
assert callable(kernels.get_kernel), "not the kernel hub"
assert callable(cachetier.kernels.gather_blocks)
for bare in ("engine", "connectors"):
    assert importlib.util.find_spec(bare) is None, bare
from transformers.utils.import_utils import is_kernels_available
assert is_kernels_available(), "transformers does not see the hub"
import cachetier.engine.llm, cachetier.connectors.hf
print("ok")
"""


def _run_check(cwd: Path, pythonpath: list[Path], ours: Path) -> None:
    assert (HF_KERNELS / "kernels" / "__init__.py").is_file(), "run `make setup`"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    done = subprocess.run(
        [sys.executable, "-c", CHECK_BOTH, str(HF_KERNELS), str(ours)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.slow(reason="imports transformers, the kernel hub and the engine in a fresh process")
def test_the_development_install_and_the_kernel_hub_import_side_by_side(tmp_path: Path) -> None:
    _run_check(tmp_path, [HF_KERNELS], ROOT / "kernels")


@pytest.mark.slow(
    reason="builds the wheel with pip and imports it with transformers in a fresh process"
)
def test_the_wheel_holds_one_top_level_name_and_sits_beside_the_hub(tmp_path: Path) -> None:
    # Built from a copy of what the wheel holds, as scripts/setup_server.sh builds it: a build
    # in the checkout would leave build/ there and race with another suite's build.
    source = tmp_path / "src"
    source.mkdir()
    for part in copied_parts():
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy2
        copy(ROOT / part, source / part)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("cachetier-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"cachetier"}
    assert "cachetier/kernels/csrc/paged_attention_cpu.cpp" in names
    # The unpacked wheel comes first on the path, before the checkout's editable install.
    _run_check(tmp_path, [tmp_path / "site", HF_KERNELS], tmp_path / "site" / "cachetier")
