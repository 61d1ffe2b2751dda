# Two entry points: `make run` (main job on the built-in tiny model) and `make test`.
# Each creates the virtual environment it needs, with the exact versions of requirements.lock.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
EXTRAS ?= dev

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[$(EXTRAS)]'
	touch $@

.PHONY: install run test test-fast soak lock
install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m gdn_jax

# The server tests run in a process of their own: their engine thread compiles step shapes, which once aborted
# inside XLA after the rest of the suite had filled the process (see tests/gdn_jax/test_server.py).
test: $(VENV)/.installed
	$(PY) -m pytest -q --ignore=tests/gdn_jax/test_server.py
	$(PY) -m pytest -q tests/gdn_jax/test_server.py

test-fast: $(VENV)/.installed  # everything but the tests marked slow
	$(PY) -m pytest -q -m "not slow"

# Long randomized property run for offline soak (CI uses the derandomized "ci" profile of tests/conftest.py).
soak: $(VENV)/.installed
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -q tests/scheduler/test_scheduler_properties.py

# Refresh the lock: resolve the newest versions pyproject.toml allows in a scratch venv, write them to
# requirements.lock, rebuild .venv from it and rerun the whole suite.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q -e '.[$(EXTRAS)]'
	(echo "# Exact versions make installs with (make lock refreshes them); pyproject.toml keeps the ranges."; \
	 .venv-lock/bin/pip freeze --all --exclude-editable | grep -v '^setuptools==\|^wheel==\|^# Editable') > $(LOCK)
	rm -rf .venv-lock $(VENV)
	$(MAKE) test
