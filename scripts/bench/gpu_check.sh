#!/usr/bin/env bash
# One pass on a machine with an NVIDIA GPU: the environment, the numerical and cache-equivalence tests on the GPU,
# scripts/bench/bench_gpu.py on the qwen3.5-9b shapes in bfloat16 (random weights: nothing is downloaded), the step's
# compile time on a few shapes, then, if asked, bench_gpu.py again under other settings (VARIANTS).
#
#     bash scripts/gpu_check.sh [OUT_DIR]        # default results/gpu
#
# It uses the Python that `PYTHON` names (default python3) with the packages it already has (JAX with its CUDA
# plugin, flax, orbax-checkpoint, safetensors, xxhash, pytest, hypothesis): the repository is put on PYTHONPATH, so
# nothing is installed and a machine without network access runs it as it is. Elsewhere, `pip install -e .[cuda,dev]`
# first. Each stage runs under its own time limit (TESTS_TIMEOUT, BENCH_TIMEOUT, COMPILE_TIMEOUT, VARIANT_TIMEOUT
# seconds; TESTS_TIMEOUT=0 or COMPILE_SHAPES=0 leaves that stage out), so a stage that hangs or runs long still leaves
# the next one its time (by default 150 + 330 + 90 s: under 10 minutes without variants); bench_gpu.py writes each
# figure to its JSON as soon as it has it. On an H200 the bench took ~130 s, of which its decode stage 68 s (most of it
# compiling the prompts' prefill), and the 133 tests more than 320 s in 14 processes (each compiles its shapes).
# Everything lands in OUT_DIR: env.txt, tests.log (pytest's summary, JUnit XML in tests.xml), bench.log,
# bench_gpu.json, compile.log, bench_compile.json and variants.json. BENCH_ARGS adds arguments to bench_gpu.py
# (e.g. "--profile", or "--preset hybrid-1024 --skip off"), COMPILE_ARGS replaces bench_compile.py's preset and dtype.
#
# On a CPU (JAX_PLATFORMS=cpu, a small BENCH_ARGS) the same script runs end to end, which checks the script only.
set -uo pipefail

out=${1:-results/gpu}
py=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}  # the tests' conftest would otherwise pin the CPU
cd "$root" || exit 1

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" - <<'EOF'
import importlib.metadata as md
import jax
for name in ("jax", "jaxlib", "flax", "orbax-checkpoint", "numpy"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
print("backend", jax.default_backend(), "devices", jax.devices())
import gdn_jax  # noqa: E402,F401  (the package imports with these versions, or nothing below can run)
print("gdn_jax imports")
EOF
} 2>&1 | tee "$out/env.txt"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
  echo "gpu_check: the environment check failed (JAX or a package missing?): see $out/env.txt" >&2
  exit "$status"
fi

# the tests whose assertions hold on any backend: the model against transformers' reference outputs, both schedules
# of the GDN rule, the scan checkpoints, restore, cache on == cache off, mixed steps, sampling, forks, prompt logprobs,
# the paged decode kernel against XLA's attention (GPU_CHECK_TESTS, a space-separated list, replaces them)
tests=(tests/gdn_jax/test_model_vs_hf.py tests/gdn_jax/test_gated_delta.py tests/gdn_jax/test_scan_checkpoints.py
       tests/gdn_jax/test_restore.py tests/gdn_jax/test_engine_cache_equivalence.py tests/gdn_jax/test_mixed_steps.py
       tests/gdn_jax/test_sampling_engine.py tests/gdn_jax/test_fork_engine.py tests/gdn_jax/test_prompt_logprobs.py
       tests/gdn_jax/test_paged_decode.py)
# shellcheck disable=SC2206  # a list of paths
[ -n "${GPU_CHECK_TESTS:-}" ] && tests=($GPU_CHECK_TESTS)
# with pytest-xdist there, TESTS_WORKERS processes (default 8) share the GPU, each allocating what it uses
workers=()
"$py" -c "import xdist" 2>/dev/null && [ "${TESTS_WORKERS:-8}" -gt 1 ] && workers=(-n "${TESTS_WORKERS:-8}")
# The tests check values, not speed: their processes compile without XLA's autotuning of the GPU's products
# (TESTS_XLA_FLAGS). On the H200 a step shape compiled with 4-5.4 CPU seconds per wall second, most likely that
# autotuning (not measured apart); the 133 tests did not all run in 320 s with it.
tests_status=0
if [ "${TESTS_TIMEOUT:-150}" -gt 0 ]; then  # TESTS_TIMEOUT=0: no test stage
  XLA_FLAGS="${XLA_FLAGS:-} ${TESTS_XLA_FLAGS---xla_gpu_autotune_level=0}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout "${TESTS_TIMEOUT:-150}" "$py" -m pytest -q -p no:cacheprovider \
    "${workers[@]}" --junitxml="$out/tests.xml" "${tests[@]}" 2>&1 | tee "$out/tests.log"
  tests_status=${PIPESTATUS[0]}
fi

# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout "${BENCH_TIMEOUT:-330}" "$py" scripts/bench/bench_gpu.py --out "$out/bench_gpu.json" ${BENCH_ARGS:-} \
  2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}

# compile time of the step on the same preset, COMPILE_SHAPES shapes spread over the warm-up grid (0: skip)
compile_status=0
if [ "${COMPILE_SHAPES:-6}" -gt 0 ]; then
  # shellcheck disable=SC2086  # COMPILE_ARGS is a list of arguments
  timeout "${COMPILE_TIMEOUT:-90}" "$py" scripts/bench/bench_compile.py --limit "${COMPILE_SHAPES:-6}" \
    --out "$out/bench_compile.json" ${COMPILE_ARGS:---preset qwen3.5-9b --dtype bfloat16} 2>&1 | tee "$out/compile.log"
  compile_status=${PIPESTATUS[0]}
fi

# VARIANTS: settings to compare, separated by ';', each a space-separated list of NAME=VALUE put in bench_gpu.py's
# environment (e.g. "GDN_JAX_PAGED_DECODE=1;GDN_JAX_PAGED_DECODE=1 GDN_JAX_UNROLL_LAYERS=decode"); each runs
# bench_gpu.py with VARIANT_ARGS (default: the decode stage alone, traced) under VARIANT_TIMEOUT seconds. Their
# results go into one file, variants.json: [{"env", "exit", "result", "log_tail"}, ...].
variant_status=()
if [ -n "${VARIANTS:-}" ]; then
  IFS=';' read -ra sets <<<"$VARIANTS"
  for i in "${!sets[@]}"; do
    # shellcheck disable=SC2086  # each set and VARIANT_ARGS are lists
    env ${sets[$i]} timeout "${VARIANT_TIMEOUT:-150}" "$py" scripts/bench/bench_gpu.py --out "$out/variant_$i.json" \
      ${VARIANT_ARGS:---skip forward,ttft,off --profile} >"$out/variant_$i.log" 2>&1
    variant_status+=("$?")
    echo "gpu_check: variant ${sets[$i]}: exit ${variant_status[$i]}"
  done
  # one file for them all (what comes back from a machine may be limited in number of files)
  "$py" -c '
import json, os, sys
out, sets, status = sys.argv[1], sys.argv[2].split(";"), sys.argv[3].split()
found = []
for i, (env, code) in enumerate(zip(sets, status)):
    path, log = (os.path.join(out, f"variant_{i}.{ext}") for ext in ("json", "log"))
    found.append({"env": env, "exit": int(code), "result": json.load(open(path)) if os.path.exists(path) else None,
                  "log_tail": open(log).read()[-3000:]})
    for name in (path, log):
        if os.path.exists(name):
            os.remove(name)
json.dump(found, open(os.path.join(out, "variants.json"), "w"), indent=1)
' "$out" "$VARIANTS" "${variant_status[*]}"
fi

echo "gpu_check: tests exit $tests_status, bench_gpu exit $bench_status, bench_compile exit $compile_status," \
  "variants exit ${variant_status[*]:-none} (124: its time limit); results in $out"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$compile_status" -eq 0 ]
