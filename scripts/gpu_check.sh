#!/usr/bin/env bash
# The CUDA checks on a GPU machine that has a CUDA build of torch (and Triton, transformers,
# safetensors) installed but no package registry: what the README's "What has run on CUDA"
# figures come from. `make test-gpu` is the same tests in a virtual environment of their own,
# where a registry can be reached.
#
#   bash scripts/gpu_check.sh OUT_DIR [MODEL_LIKE_DIR]
#
# - Wheels for what is missing there (lz4, redis, hiredis, cryptography, cffi, pycparser,
#   uvicorn: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` on a machine
#   that reaches a registry) are installed from WHEELS (default: .whl) into a private folder.
# - The `cuda` tests run (but the vLLM one, which needs a CUDA build of vLLM), then, where
#   MODEL_LIKE_DIR holds a model's config and tokenizer (SmolLM2's weights are a 93 MB wheel),
#   a random-weight copy of it is restarted from disk and its steps and overlap are timed.
# - Each step has its own time limit (seconds: TESTS_S, RESTART_S, STEPS_S, OVERLAP_S), so one
#   slow step leaves the rest their time; every log lands in OUT_DIR.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [MODEL_LIKE_DIR]}
like=${2:-}
wheels=${WHEELS:-.whl}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/*.whl || exit 1
  export PYTHONPATH="$site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null
} | tee "$out/machine.txt"

step() {  # name, seconds, command...: run under a limit, log to OUT_DIR/name.txt, say how it ended
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s); last line:"
  tail -n 1 "$out/$name.txt"
}

step tests "${TESTS_S:-200}" "$python" -m pytest -q -rs -p no:cacheprovider \
  -m "cuda and not vllm" tests/gpu
if [ -n "$like" ]; then
  model=$(mktemp -d)/random-model
  "$python" -m benchmarks.support.random_model --like "$like" --out "$model" >/dev/null || exit 1
  work=$(mktemp -d -p "${WORK_DIR:-/var/tmp}")
  step restart "${RESTART_S:-240}" "$python" -m benchmarks.restart --json --device cuda \
    --model "$model" --no-redis --also --repeats 1 --disk-runs 3 --work-dir "$work"
  step steps "${STEPS_S:-120}" "$python" -m benchmarks.steps --json --device cuda \
    --model "$model"
  step overlap "${OVERLAP_S:-90}" "$python" -m benchmarks.overlap --json --device cuda \
    --model "$model" --work-dir "$work"
fi
