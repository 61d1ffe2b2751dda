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

# The suite runs as several pytest processes. Each compiled XLA executable keeps memory mappings, and one process
# that compiled the whole suite's few hundred step shapes aborted inside LLVM (vm.max_map_count is 65530 here);
# each group below compiles a fraction of that. The server tests also get their own process (their engine thread
# compiles). .ci/run raises vm.max_map_count where it may.
GROUP_A := tests/scheduler tests/test_cli_help.py
GROUP_B := tests/gdn_jax/test_donation.py tests/gdn_jax/test_engine.py tests/gdn_jax/test_engine_cache_equivalence.py \
           tests/gdn_jax/test_scan_checkpoints.py tests/gdn_jax/test_mixed_steps.py \
           tests/gdn_jax/test_fork_engine.py tests/gdn_jax/test_memory_plan.py
GROUP_C := tests/gdn_jax/test_decode_path.py tests/gdn_jax/test_model.py tests/gdn_jax/test_model_vs_hf.py tests/gdn_jax/test_prompt_logprobs.py \
           tests/gdn_jax/test_restore.py tests/gdn_jax/test_sampling.py tests/gdn_jax/test_sampling_engine.py \
           tests/gdn_jax/test_accelerator_forms.py tests/gdn_jax/test_gated_delta.py tests/gdn_jax/test_cpu_kernels.py
GROUP_D := tests/gdn_jax/test_tiny_model.py tests/gdn_jax/test_weights.py tests/gdn_jax/test_shape_buckets.py \
           tests/gdn_jax/test_executables.py tests/gdn_jax/test_text_stream.py tests/gdn_jax/test_server_default_compile.py
# The server, training, the studies, the notebooks and the scripts are tested for what they do with the model's
# results (requests, streams, resumes, tables, files), each against itself: their processes compile with LLVM's
# optimisation off, which halves their compile time, most of their time (on the tiny model a float32 logprob moves
# by ~1e-5 at most, a bfloat16 one by up to ~0.02; greedy tokens stayed the same), and with the LLVM IR emitters for
# every program (the engine's prefill steps use them anyway; the training, TTFT-study and notebook tests took ~15%
# less time with them). The groups above, which test the numbers a user gets (the model, exactness of the
# cache, decode and sampling paths, the shipped model's card, stored executables, and the server's engine thread
# compiling a request's shapes: test_server_default_compile.py), compile as a user's engine does. (Group B compiled
# with the flags above took 219 against 343 s, but C, which loads many of B's steps from the lane's cache, then took
# ~160 s longer: no gain for the lane.)
# Where the CPU kernels build (gdn_jax/cpu_kernels.py: a C++ compiler on PATH) the groups above run them;
# XLA's forms of the GDN update and of one-token attention, which run where they do not (and on accelerators), keep
# the tests that depend on them in a process of their own: every step shape in place, and a one-token step's rows
# a few at a time. (The rest of those files' tests take the same path either way and run once, above. XLA's forms of
# the prefill rule, the "fused" and "parallel" schedules, run above by the engine's `gdn_schedule`.)
XLA_FORMS := GDN_JAX_CPU_KERNELS=0
GROUP_XLA_FORMS := tests/gdn_jax/test_donation.py \
                   "tests/gdn_jax/test_decode_path.py::test_rows_a_few_at_a_time_equal_all_rows_at_once[1]"
PLUMBING := XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# `make test` runs the groups in two lanes at once (a step compiles on one core, and most of the suite's time is
# compiling): A (no compiling), B, then C, which runs many steps B compiled; and the rest (the whole run 11.5 minutes
# on a 2-core AMD EPYC, 16-17 on the 2-core AMX Xeon, at the last measures). Each lane's groups run in order; each
# group's output is printed when it ends. A lane's groups share compiled executables through JAX's persistent
# compilation cache (tests/conftest.py) in a folder of the lane's own under .cache/jax-test (two processes never
# write and read one folder at once): most engines of the suite have one of a few geometries, so a group loads what
# an earlier one compiled. `make test-serial` runs the same groups one after another. Every edit of the package
# adds entries to those folders and none are read back after a later edit, so `make test` first deletes the entries
# written more than a week ago (one still in use is compiled again once).
.PHONY: test-serial test-lane-engine test-lane-rest
test-lane-engine: export GDN_JAX_TEST_COMPILE_CACHE = $(CURDIR)/.cache/jax-test/engine
test-lane-rest: export GDN_JAX_TEST_COMPILE_CACHE = $(CURDIR)/.cache/jax-test/rest
test: $(VENV)/.installed
	@if [ -d .cache/jax-test ]; then find .cache/jax-test -type f -mtime +7 -delete; fi
	$(MAKE) --no-print-directory -j2 --output-sync=line test-lane-engine test-lane-rest
test-serial: test-lane-engine test-lane-rest
test-lane-engine: $(VENV)/.installed
	$(PY) -m pytest -q $(GROUP_A)
	$(PY) -m pytest -q $(GROUP_B)
	$(PY) -m pytest -q $(GROUP_C)
test-lane-rest: $(VENV)/.installed
	$(PY) -m pytest -q $(GROUP_D)
	$(XLA_FORMS) $(PY) -m pytest -q $(GROUP_XLA_FORMS)
	$(PLUMBING) $(PY) -m pytest -q tests/gdn_jax/test_server.py
	$(PLUMBING) $(PY) -m pytest -q tests/gdn_jax/test_train.py tests/test_studies.py tests/test_notebooks.py  # the accuracy notebook reuses the study's steps
	$(PLUMBING) $(PY) -m pytest -q tests/test_bench_scripts.py

# The comparison with transformers needs torch and transformers (the reference extra, CPU torch): a venv of its own,
# so that `make test` never installs them.
test-reference: EXTRAS = dev,reference
test-reference: PY = $(REF_VENV)/bin/python
test-reference: $(REF_VENV)/.installed
	$(PY) -m pytest -q tests/reference

test-fast: $(VENV)/.installed  # everything but the tests marked slow
	$(PY) -m pytest -q -m "not slow"

# Long randomized runs for an offline soak: the scheduler's properties (CI uses the derandomized "ci" profile of
# tests/conftest.py), then random engine workloads, cache on, against each request alone with the cache off
# (SOAK_MINUTES, default 10; CI runs one round of it).
SOAK_MINUTES ?= 10
soak: $(VENV)/.installed
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -q tests/scheduler/test_scheduler_properties.py
	$(PY) scripts/soak_cache.py --minutes $(SOAK_MINUTES) --seed $$(date +%s)

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
