# `make demo`: set up .venv and run the demo pipeline. `make test`: set up .venv and run the tests.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup demo test test-fast bench lint clean

setup: $(STAMP)

# torch first, alone: pip then takes the CPU build on this disk instead of a multi-GB CUDA one.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==26.3
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flywheel run demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# Every benchmark in full (tens of minutes); each prints its figures as one JSON line last. rl_gain starts from the
# demo's SFT checkpoint, hence the demo run first (all cached after `make demo`). benchmarks/gpu_check.py needs a GPU.
bench: $(STAMP)
	$(BIN)/python benchmarks/collect.py
	$(BIN)/python benchmarks/synthesis.py
	$(BIN)/python benchmarks/envs.py
	$(BIN)/python benchmarks/replay.py
	$(BIN)/python benchmarks/sft.py
	$(BIN)/python benchmarks/rl_async.py
	$(BIN)/python benchmarks/demo_student.py
	$(BIN)/python benchmarks/serve.py
	$(BIN)/flywheel run demo
	$(BIN)/python benchmarks/rl_gain.py --student models/demo/sft

lint: $(STAMP)
	$(BIN)/ruff check flywheel tasks flows tests benchmarks

clean:
	rm -rf data models .flywheel dvc.lock
