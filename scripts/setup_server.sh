#!/usr/bin/env bash
# The sidecar's environment: the cachetier wheel of a checkout with only its `server` extra,
# in a fresh venv. No torch, no transformers, no vLLM: the script fails if one got in.
# The sidecar image runs it (Dockerfile, target `sidecar`), and so does
# tests/deploy/test_server_install.py, which then serves, stores and reports from that venv.
#
#   bash scripts/setup_server.sh VENV [CHECKOUT]
set -euo pipefail
venv=${1:?usage: setup_server.sh VENV [CHECKOUT]}
src=${2:-.}
python=${PYTHON:-python3}

"$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# pip builds a source folder in place (build/, *.egg-info): a copy keeps the checkout clean and
# lets two builds run at once. What is copied is what the wheel holds: pyproject.toml's
# package folders (tests/deploy/test_server_install.py checks the two lists agree), its readme
# and its license.
mkdir "$work/src"
for part in pyproject.toml README.md LICENSE cachetier engine kernels connectors; do
  cp -R "$src/$part" "$work/src/"
done
$pip wheel --quiet --no-deps --wheel-dir "$work/wheels" "$work/src"
wheels=("$work"/wheels/cachetier-*.whl)
$pip install --quiet "${wheels[0]}[server]"
"$venv/bin/python" - <<'EOF'
import importlib.util
import sys

heavy = [m for m in ("torch", "transformers", "vllm", "triton") if importlib.util.find_spec(m)]
sys.exit(f"the server extra brought {', '.join(heavy)}" if heavy else 0)
EOF
