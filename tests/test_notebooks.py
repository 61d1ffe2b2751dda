"""Every notebook under notebooks/ runs top to bottom (code cells executed in order in one namespace), in its reduced
mode (GDN_JAX_NOTEBOOK_REDUCED=1: fewer training steps, smaller workloads), prints what it is there to show, and ends
with the values it claims (read from the notebook's namespace)."""

import ast
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.studies

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _walkthrough(ns):
    a, b = ns["first"], ns["second"]
    assert (a.num_cached_tokens, a.metrics.restored) == (0, False)
    # b shares 136 tokens with a: 8 whole KV blocks (128), checkpoints every 32 up to 128, all reused by a restore
    assert (b.metrics.kv_match, b.metrics.linear_reach, b.num_cached_tokens, b.metrics.reuse_lost) == (128, 128, 128, 0)
    steps, slots = ns["steps"], ns["pool"].num_slots - 1
    assert all(s["live"] + s["pinned"] + s["checkpoint"] + s["saving"] + s["free"] == slots for s in steps)
    assert max(s["saving"] for s in steps) > 0  # prefill steps write checkpoints (checkpoint_mode "scan")
    assert max(s["live"] for s in steps) == ns["SEQS"]
    # every later turn restores a checkpoint of its own conversation, under eviction pressure
    later = [o for t, _, o in ns["requests"] if t > 0]
    assert later and all(o.metrics.restored and o.num_cached_tokens >= 32 for o in later)
    assert steps[-1]["evicted"] > 0


def _accuracy(ns):
    s = ns["summary"]
    assert s["exact"]["kl_max"] < 1e-6 and s["exact"]["greedy_agreement"] == 1.0
    for name in ("unsafe_cold", "unsafe_stale"):
        assert s[name]["kl_mean"] > 0.01 and s[name]["greedy_agreement"] < 1.0, name
        assert s[name]["mean_cached_tokens"] > s["exact"]["mean_cached_tokens"], name
    for name in ("ckpt_bfloat16", "ckpt_int8", "ckpt_float8"):  # exact's reuse, from rounded checkpoints
        assert s["exact"]["kl_mean"] < s[name]["kl_mean"] < s["unsafe_cold"]["kl_mean"], name
    # speculation: exact's reuse and outputs
    assert s["spec"]["greedy_agreement"] == 1.0 and s["spec"]["kl_max"] < 1e-6
    assert s["spec"]["mean_cached_tokens"] == s["exact"]["mean_cached_tokens"]
    assert ns["fig"].axes[0].get_yscale() == "log" and len(ns["fig"].axes[0].lines) == 7


def _policies(ns):
    workloads = ns["workloads"]
    assert set(workloads) == {"chat", "agentic", "fewshot"}
    assert all(set(rows) == {"lru", "flop_aware", "overlap", "end_of_turn"} for rows in workloads.values())
    for name, rows in workloads.items():  # every policy exact, in the same checkpoint bytes
        assert all(r["exact"] and 0 < r["token_hit_rate"] <= 1 for r in rows.values()), name
        assert len({r["checkpoint_bytes"] for r in rows.values()}) == 1, name
    assert all(len(ax.patches) == 12 for ax in ns["axes"])  # 3 workloads x 4 policies, hit rate and saves


# what each notebook's output must contain, and the checks on its namespace
EXPECTED = {
    "01_prefix_cache_walkthrough.ipynb": (
        ["restored True", "same tokens as without the cache True", "every slot in exactly one state at every step True",
         "pinned during restores True", "checkpoints evicted under pressure True"], _walkthrough),
    "02_accuracy_study.ipynb": (
        ["exact == no_cache (KL max < 1e-6, greedy agreement 1.0) True", "unsafe_cold drifts True",
         "unsafe_stale drifts True", "reusing as exact does True"], _accuracy),
    "03_policies.ipynb": (
        ["every policy exact (cache on == off on every workload) True",
         "flop_aware hit rate >= lru on chat and agentic True", "end_of_turn hit rate > lru on chat True"],
        _policies),
    "train_tiny.ipynb": (["loss decreased True", "restored True"], None),
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
    markers, check = EXPECTED[path.name]
    for marker in markers:
        assert marker in out, marker
    if check is not None:
        check(namespace)


def _requirement_names(reqs) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _imported_modules(source: str) -> set[str]:
    """The dotted names of the modules `source` imports (at any depth: a function's import runs when it is called)."""
    tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_the_notebooks_extra_installs_what_the_notebooks_import():
    """`pip install gdn-jax[notebooks]` is enough to run every notebook: each third-party module a notebook imports
    (in its cells, or at the top of a script of scripts/ it imports) comes from the core dependencies or that
    extra."""
    root = NOTEBOOKS[0].parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    allowed = _requirement_names(project["dependencies"] + project["optional-dependencies"]["notebooks"])
    scripts = {p.stem: p for p in (root / "scripts").rglob("*.py")}
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        modules = set().union(*(_imported_modules("".join(c["source"])) for c in cells if c["cell_type"] == "code"))
        # one level into what the notebook imports of the project: a script, or a module of the package
        for name in sorted(modules):
            file = scripts.get(name) or root / (name.replace(".", "/") + ".py")
            if name.split(".")[0] in {"gdn_jax", "scheduler", *scripts} and file.is_file():
                modules |= _imported_modules(file.read_text())
        tops = {name.split(".")[0] for name in modules}
        for name in sorted(tops - set(sys.stdlib_module_names) - scripts.keys() - {"gdn_jax", "scheduler"}):
            dists = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
            if not dists & allowed:
                missing.setdefault(path.name, []).append(name)
    assert not missing, f"imported by notebooks, not in the core dependencies or the notebooks extra: {missing}"
