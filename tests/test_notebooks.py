"""Every notebook under notebooks/ runs top to bottom (code cells executed in order in one namespace), in its reduced
mode (GDN_JAX_NOTEBOOK_REDUCED=1: fewer training steps), and prints what it is there to show."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))

# what each notebook's output must contain
EXPECTED = {
    "01_prefix_cache_walkthrough.ipynb": ["restored True"],  # the second request really restored a checkpoint
    "train_tiny.ipynb": ["loss decreased True", "restored True"],
}


def test_there_are_notebooks_and_each_has_expectations():
    assert NOTEBOOKS
    assert sorted(p.name for p in NOTEBOOKS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys, monkeypatch):
    monkeypatch.setenv("GDN_JAX_NOTEBOOK_REDUCED", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    cells = json.loads(path.read_text())["cells"]
    namespace = {"__name__": "__notebook__"}
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        exec(compile("".join(cell["source"]), f"{path.name}[{i}]", "exec"), namespace)
    out = capsys.readouterr().out
    for marker in EXPECTED[path.name]:
        assert marker in out, marker
