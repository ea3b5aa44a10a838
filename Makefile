# `make train` and `make test` each set up .venv first (idempotent), then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-all bench clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m grpo.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow" $(ARGS)

bench: $(STAMP)
	$(PY) -m grpo.bench $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
