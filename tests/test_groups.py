"""`make test` runs each group of tests in a pytest process of its own (`-m EXPR`), which collects only the modules
that can hold one of the group's tests (tests/conftest.py, `may_hold`): no test of a group may be left out that way,
and every test is in some group."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import may_hold, selects

ROOT = Path(__file__).resolve().parent.parent
DUMP = '''
import json, os

def pytest_collection_finish(session):
    with open(os.environ["MARKERS_OUT"], "w") as f:
        json.dump([[item.nodeid, sorted({m.name for m in item.iter_markers()})] for item in session.items], f)
'''


def _makefile_groups() -> list[str]:
    """The `-m` expressions of `make test`'s pytest processes."""
    text = (ROOT / "Makefile").read_text()
    test_part = text[text.index("test-lane-engine: $(VENV)/.installed"):text.index("test-reference:")]
    return [quoted or word for quoted, word in re.findall(r'\$\(PYTEST\) -m (?:"([^"]+)"|(\w+))', test_part)]


def test_each_groups_process_collects_every_module_holding_one_of_its_tests(tmp_path):
    groups = _makefile_groups()
    assert len(groups) == 11 and "studies" in groups and "mesh" in groups
    (tmp_path / "marker_dump.py").write_text(DUMP)
    out = tmp_path / "markers.json"
    env = {"PYTHONPATH": str(tmp_path), "MARKERS_OUT": str(out)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "marker_dump",
                          "--ignore=tests/reference", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    items = json.loads(out.read_text())
    assert len(items) > 1000
    missed, orphans = {}, []
    for nodeid, names in items:
        chosen = [expr for expr in groups if selects(expr, set(names))]
        if not chosen:
            orphans.append(nodeid)
        for expr in chosen:
            if not may_hold(ROOT / nodeid.split("::")[0], expr):
                missed.setdefault(expr, []).append(nodeid)
    assert not missed, f"tests a group's process would not collect: {missed}"
    assert not orphans, f"tests in no group of make test: {orphans[:10]}"


def test_a_modules_own_marks_count_with_its_module_mark(tmp_path):
    """A module of one group holding a test of another (a test's own mark) is collected for both; one naming
    neither is collected only where the expression allows a test with neither."""
    mixed = tmp_path / "test_mixed.py"
    mixed.write_text("import pytest\npytestmark = pytest.mark.engine\nLATE = pytest.mark.compiled\n")
    plain = tmp_path / "test_plain.py"
    plain.write_text("def test_x():\n    pass\n")
    assert may_hold(mixed, "engine and not mesh") and may_hold(mixed, "compiled and not mesh")
    assert not may_hold(mixed, "model") and not may_hold(mixed, "not (engine or compiled)")
    assert may_hold(plain, "not (engine or compiled)") and not may_hold(plain, "studies")
