import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_scheduler_modules_never_import_jax():
    modules = sorted(p.stem for p in (ROOT / "scheduler").glob("*.py") if p.stem != "__init__")
    assert {"scheduler", "composite", "linear_cache", "kv_cache", "sequence"} <= set(modules)
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module('scheduler.' + m)\n"
            "import scheduler\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
