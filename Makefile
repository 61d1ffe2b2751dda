# Two entry points: `make run` (main job on the built-in tiny model) and `make test`.
# Each creates the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

.PHONY: install run test
install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m gdn_jax

test: $(VENV)/.installed
	$(PY) -m pytest -q
