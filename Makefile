# kvguard: `make run` starts the local stack, `make test` runs the whole suite; both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION := 2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup monitoring-tools run stack test test-slow clean

setup: $(STAMP)

# Idempotent: the stamp is rebuilt only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first when there is no GPU: a bare `torch` requirement would pull GBs of CUDA wheels.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test,dev,bench]"
	touch $(STAMP)

# promtool, amtool, Prometheus and Alertmanager for the alert tests and the live-stack test (Debian's
# packages; CI runs as root). Skipped when the binaries are already there.
MONITORING_BINARIES := promtool amtool prometheus prometheus-alertmanager
APT_MONITORING := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	prometheus prometheus-alertmanager
monitoring-tools:
	@for b in $(MONITORING_BINARIES); do command -v $$b >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then $(APT_MONITORING) || { apt-get update && $(APT_MONITORING); }; fi

run: setup
	$(PY) scripts/run_stack.py

# `make run` plus Prometheus, Alertmanager and an alert printer, with the configs docker-compose.yml uses.
stack: setup monitoring-tools
	$(PY) scripts/monitoring_stack.py

test: setup monitoring-tools
	$(PY) -m pytest -q

# Minutes-long runs (e.g. 2-minute benign traffic for the attack detector); not part of make test.
test-slow: setup
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
