# Two entry points: `make run` (main job on the built-in tiny model) and `make test`.
# Each creates the virtual environment it needs, with the exact versions of requirements.lock.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements.lock
EXTRAS ?= dev

REF_VENV := .venv-ref

%/.installed: pyproject.toml $(LOCK)  # any venv folder: .venv, or .venv-ref for test-reference
	$(PYTHON) -m venv $*
	$*/bin/python -m pip install -q -c $(LOCK) pip
	$*/bin/python -m pip install -q -c $(LOCK) -e '.[$(EXTRAS)]'
	touch $@

.PHONY: install run test test-fast test-reference soak lock notebooks
install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m gdn_jax

# `make test`: one pytest process per group of test modules (a module names its group in `pytestmark`; pyproject.toml
# lists the groups), since one process compiling all the suite's step shapes ran out of memory maps (.ci/run raises
# vm.max_map_count). Compiling takes most of the time, on one core, so two lanes of processes run at once; a lane's
# processes share compiled executables through JAX's persistent cache in a folder of its own (tests/conftest.py),
# and each collects only the modules that can hold its group's tests (tests/test_groups.py checks that rule).
# Modules that name no group run in the engine lane's fourth process. Every group but the compiled and the
# deterministic mode's compiles with LLVM's optimisation off (in half the time): the engine's behaviour and
# exactness, the model's parts against their references, loading and starting, what the server, training, the
# studies and the scripts do with the model's results, and the mesh tests (tensor and expert parallelism against one
# device, in a process of 8 host devices). The compiled group, compiled as a user's engine is, holds the claims about
# the code XLA emits (pools updated in place, bitwise-equal states, the server's compile options) and speculation
# (its sampling test runs many steps); the deterministic mode's bit-identity holds with XLA's fusions as a user's
# engine has them, LLVM's optimisation off (`make soak` runs it at XLA's defaults, with many more examples); the
# xla_forms tests run (again) with the CPU kernels off, in XLA's forms.
PYTEST = $(PY) -m pytest -q --ignore=tests/reference
PLUMBING := XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
.PHONY: test-serial test-lane-engine test-lane-rest
# Python writes the test modules as pytest rewrote them, and the package's bytecode, once for every process (an
# environment that turns bytecode off would have each process rewrite them: seconds a process).
test-lane-engine test-lane-rest: export PYTHONDONTWRITEBYTECODE =
test-lane-engine: export GDN_JAX_TEST_COMPILE_CACHE = $(CURDIR)/.cache/jax-test/engine
test-lane-rest: export GDN_JAX_TEST_COMPILE_CACHE = $(CURDIR)/.cache/jax-test/rest
test: $(VENV)/.installed
	@if [ -d .cache/jax-test ]; then find .cache/jax-test -type f -mtime +7 -delete; fi  # what older edits of the package wrote
	$(MAKE) --no-print-directory -j2 --output-sync=line test-lane-engine test-lane-rest
test-serial: test-lane-engine test-lane-rest
test-lane-engine: $(VENV)/.installed
	$(PLUMBING) $(PYTEST) -m "engine and not mesh"
	$(PYTEST) -m "compiled and not mesh"
	$(PLUMBING) $(PYTEST) -m model
	$(PYTEST) -m "not (engine or compiled or model or startup or server or studies or bench or mesh or deterministic or xla_forms)"
	$(PLUMBING) $(PYTEST) -m studies
test-lane-rest: $(VENV)/.installed
	$(PLUMBING) $(PYTEST) -m startup
	$(PLUMBING) $(PYTEST) -m server
	$(PLUMBING) $(PYTEST) -m bench
	XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0" $(PYTEST) -m deterministic
	GDN_JAX_CPU_KERNELS=0 $(PYTEST) -m xla_forms
	XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false \
	  --xla_force_host_platform_device_count=8" $(PYTEST) -m mesh

# The comparison with transformers needs torch and transformers (the reference extra, CPU torch): a venv of its own,
# so that `make test` never installs them.
test-reference: EXTRAS = dev,reference
test-reference: PY = $(REF_VENV)/bin/python
test-reference: $(REF_VENV)/.installed
	$(PY) -m pytest -q tests/reference

test-fast: $(VENV)/.installed  # everything but the tests marked slow
	$(PY) -m pytest -q -m "not slow and not mesh"
	XLA_FLAGS="$$XLA_FLAGS --xla_force_host_platform_device_count=8" $(PY) -m pytest -q -m "mesh and not slow"

# Long randomized runs for an offline soak: the scheduler's properties and the deterministic mode's bit-identity
# (CI uses the derandomized "ci" profile of tests/conftest.py), then random engine workloads, cache on, against each
# request alone with the cache off (SOAK_MINUTES, default 10; CI runs one round of it).
SOAK_MINUTES ?= 10
soak: $(VENV)/.installed
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -q tests/scheduler/test_scheduler_properties.py tests/gdn_jax/test_deterministic.py
	$(PY) scripts/tools/soak_cache.py --minutes $(SOAK_MINUTES) --seed $$(date +%s)

# Re-executes the study notebooks in place, so that the outputs committed with them are those of a real full run.
NOTEBOOKS := notebooks/01_prefix_cache_walkthrough.ipynb notebooks/02_accuracy_study.ipynb
notebooks: $(VENV)/.installed
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=3600 $(NOTEBOOKS)

# Refresh the lock: resolve the newest versions pyproject.toml allows (dev and reference extras) in a scratch venv,
# write them to requirements.lock, rebuild .venv from it and rerun the whole suite.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q -e '.[$(EXTRAS),reference]'
	(echo "# Exact versions make installs with (make lock refreshes them); pyproject.toml keeps the ranges."; \
	 .venv-lock/bin/pip freeze --all --exclude-editable | grep -v '^setuptools==\|^wheel==\|^# Editable' \
	 | sed 's/^\(torch==[0-9.]*\)+.*/\1/') > $(LOCK)  # torch==X.Y.Z, not the local +cpu build label
	rm -rf .venv-lock $(VENV)
	$(MAKE) test
