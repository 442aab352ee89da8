#!/usr/bin/env bash
# Creates .venv-peers: LMCache 0.5.6 and cachetier in one environment, so one benchmark process
# can alternate between both on the same bytes (python -m benchmarks.peers).
# Kept apart from .venv because lmcache pulls ~100 packages (cupy among them) and its resolver
# takes minutes; nothing in `make test` needs it. Idempotent: a stamp skips the work when this
# script and pyproject.toml have not changed since the last run.
set -euo pipefail
venv=${1:-.venv-peers}
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
# torch first and exactly: the CPU wheel. With it in place lmcache's resolver keeps it instead
# of pulling a CUDA build.
$pip install --quiet "torch==2.13.0"
$pip install --quiet "lmcache==0.5.6"
# Ours without letting its resolver move what lmcache pinned, then only what is still missing
# of our runtime and server dependencies (pip leaves satisfied ones alone).
$pip install --quiet --no-deps -e .
$pip install --quiet -e ".[server]"
"$venv/bin/python" -c "import torch; assert not torch.cuda.is_available(), torch.__version__"
"$venv/bin/python" -c "import lmcache.v1.storage_backend, cachetier.tiers.remote, cachetier.server.app"
# Report (do not fail on) conflicts between lmcache's pins and ours.
$pip check || echo "setup_peers.sh: pip check found the conflicts above" >&2
touch "$stamp"
