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
