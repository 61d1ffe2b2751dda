"""Every command-line flag of every script and of `python -m gdn_jax` documents itself (read from the source)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "gdn_jax").glob("*.py"))


def _add_argument_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            yield node


@pytest.mark.parametrize("path", [p for p in SOURCES if any(_add_argument_calls(p))], ids=lambda p: p.name)
def test_every_flag_has_a_help_text(path):
    missing = [ast.unparse(call.args[0]) for call in _add_argument_calls(path)
               if not any(k.arg == "help" and ast.unparse(k.value).strip("'\"") for k in call.keywords)]
    assert not missing, f"{path.name}: flags without help: {missing}"


def test_module_entry_point_names_itself(capsys):
    from gdn_jax.__main__ import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m gdn_jax") and "(default: tiny)" in out


def test_make_test_runs_every_test_file():
    """`make test` lists its test files in process groups: a new file left out of every group would never run in CI."""
    import re
    recipe = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = set()
    for line in recipe.splitlines():
        if re.match(r"(GROUP_\w+ :=|\t\$\(PY\) -m pytest)", line):
            listed.update(re.findall(r"tests/[\w/]+(?:\.py)?", line))
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(f for f in files if not any(f == t or f.startswith(t.rstrip("/") + "/") for t in listed))
    assert not missing, f"test files in no group of `make test`: {missing}"
