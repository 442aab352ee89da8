# The README's two commands are `make demo` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench bench-peers lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

demo: setup
	$(PY) -m engine.demo

test: setup
	$(PY) -m pytest -q

# Everything but the slow, model, vLLM and fault suites: the inner loop, under 5 minutes.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not model and not vllm and not faults"

bench: setup
	$(PY) benchmarks/bench_tiers.py --json

lint: setup
	$(PY) -m ruff check cachetier engine kernels connectors tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
