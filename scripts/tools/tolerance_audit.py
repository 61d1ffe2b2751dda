"""Measures how much of each numerical tolerance the test suite actually uses, under several XLA/thread settings.

Every `np.testing.assert_allclose` in the chosen tests is wrapped: per call site (test file:line) it records the
largest absolute difference and the largest fraction of the allowed error used, `max(|a - e| / (atol + rtol |e|))`.
Each setting runs in its own process (XLA flags are read at start-up). A bound set at about 4x the worst case seen
has a used fraction of at most 0.25 everywhere.

    .venv/bin/python scripts/tools/tolerance_audit.py                 # all settings, the numerical test files
    .venv/bin/python scripts/tools/tolerance_audit.py --settings default one-core
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
NUMERICAL_TESTS = ["tests/gdn_jax/test_model_vs_hf.py", "tests/gdn_jax/test_gated_delta.py",
                   "tests/gdn_jax/test_model.py", "tests/gdn_jax/test_restore.py",
                   "tests/gdn_jax/test_engine_cache_equivalence.py", "tests/gdn_jax/test_sampling.py"]
# name -> (extra environment, command prefix)
SETTINGS = {
    "default": ({}, []),
    "no-eigen-threads": ({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}, []),
    "one-core": ({}, ["taskset", "-c", "0"]),
    "compile-cache": ({"GDN_JAX_TEST_COMPILE_CACHE": "1"}, []),
}

PLUGIN = '''
import inspect, json, os
import numpy as np
_orig = np.testing.assert_allclose
_records = {}

def _site():
    for frame in inspect.stack()[2:]:
        if "/tests/" in frame.filename and frame.function.startswith("test"):
            return f"{os.path.relpath(frame.filename)}:{frame.lineno}"
    return "?"

def _wrapped(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
    a = np.asarray(actual, np.float64); e = np.asarray(desired, np.float64)
    a, e = np.broadcast_arrays(a, e)
    if a.size:
        diff = np.abs(a - e)
        allowed = atol + rtol * np.abs(e)
        used = float(np.max(np.where(allowed > 0, diff / np.where(allowed > 0, allowed, 1), np.where(diff > 0, np.inf, 0))))
        r = _records.setdefault(_site(), {"max_abs_diff": 0.0, "max_used": 0.0, "atol": atol, "rtol": rtol})
        r["max_abs_diff"] = max(r["max_abs_diff"], float(diff.max()))
        r["max_used"] = max(r["max_used"], used)
    return _orig(actual, desired, rtol, atol, *args, **kwargs)

np.testing.assert_allclose = _wrapped

def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["TOLERANCE_AUDIT_OUT"], "w") as f:
        json.dump(_records, f)
'''


def run_setting(name: str, tests: list[str]) -> dict:
    env_extra, prefix = SETTINGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tolerance_audit_plugin.py").write_text(PLUGIN)
        out = Path(tmp) / "records.json"
        env = {**os.environ, **env_extra, "TOLERANCE_AUDIT_OUT": str(out),
               "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = prefix + [sys.executable, "-m", "pytest", "-q", "-p", "tolerance_audit_plugin", *tests]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:])
        return json.loads(out.read_text()) if out.exists() else {}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="tolerance_audit.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                    help="XLA/thread settings to run, each in its own process (default: all)")
    ap.add_argument("--tests", nargs="+", default=NUMERICAL_TESTS, help="test files or ids (default: the numerical ones)")
    ap.add_argument("--out", default="results/tolerance_audit.json", help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)

    per_setting = {}
    for name in args.settings:
        print(f"[{name}] running {len(args.tests)} test files ...", flush=True)
        per_setting[name] = run_setting(name, args.tests)
    sites = sorted({s for recs in per_setting.values() for s in recs})
    worst = {}
    print(f"\n{'call site':<52}{'atol':>9}{'rtol':>9}{'worst |diff|':>14}{'worst used':>12}  setting")
    for site in sites:
        seen = [(recs[site]["max_used"], recs[site]["max_abs_diff"], name, recs[site])
                for name, recs in per_setting.items() if site in recs]
        used, diff, name, rec = max(seen, key=lambda x: x[0])
        worst[site] = {"atol": rec["atol"], "rtol": rec["rtol"], "worst_abs_diff": max(s[1] for s in seen),
                       "worst_used": used, "setting": name}
        flag = "  <-- less than 4x headroom" if used > 0.25 else ""
        print(f"{site:<52}{rec['atol']:>9.1e}{rec['rtol']:>9.1e}{max(s[1] for s in seen):>14.3e}{used:>12.3f}  {name}{flag}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": args.settings, "sites": worst, "per_setting": per_setting},
                                         indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
