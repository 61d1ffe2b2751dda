"""Test-wide settings: CPU, the persistent compilation cache when asked for, and a deterministic hypothesis profile
(CI cannot flake; `make soak` runs the randomized long profile).

`make test` runs the suite as several pytest processes that build engines of the same model and geometry, so it
sets `GDN_JAX_TEST_COMPILE_CACHE` to a folder (one per lane of processes; "1" means .cache/jax of the clone): JAX's
persistent compilation cache, every executable kept, so that a process loads the step shapes an earlier one
compiled, in a fresh clone too, and a re-traced identical program (a fresh jit of the same function) loads instead
of compiling. Unset, the cache stays off.

Either way the engine's executable store (gdn_jax.worker.executable_store) stays off unless a test names its folder:
an executable that JAX loaded from its cache cannot be serialized again on the CPU (the copy fails at dispatch,
"Function ... not found"), and the store saves what warm-up compiled, which with the cache on may be such a load. The
subprocesses the tests start (servers, CLIs, scripts) share the lane's JAX cache, with no store either."""

import itertools
import os
import re
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["GDN_JAX_CACHE_DIR"] = "off"  # engines enable no cache of their own, here and in subprocesses

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

from gdn_jax.worker import executable_store as executables  # noqa: E402

_cache = os.environ.get("GDN_JAX_TEST_COMPILE_CACHE", "")
if _cache and _cache != "0":
    _folder = Path(__file__).resolve().parent.parent / ".cache" / "jax" if _cache == "1" else Path(_cache)
    jax.config.update("jax_compilation_cache_dir", str(_folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # the subprocesses too (servers, scripts, notebooks), through JAX's own variables: they load what the lane
    # compiled, and read the CPU choices the lane measured (kept beside the cache), where each used to compile and
    # measure afresh; a test that names a folder of its own for the engine drops them
    # (`tests.gdn_jax.helpers.own_cache_env`)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_folder)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

_default_folder = executables.default_folder
executables.default_folder = lambda cache=None: _default_folder(cache) if cache else None  # store: named folders only

# "ci" (the default): derandomized, fixed example counts, no deadline. "soak": random seeds, many more examples.
settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None, print_blob=True)
settings.register_profile("soak", derandomize=False, deadline=None, print_blob=True, max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# A group's pytest process (`make test`, `-m EXPR`) collects only the modules that can hold one of its tests: each
# collected module imports what it tests, seconds a process for the whole suite. tests/test_groups.py checks the rule
# against a full collection.
_WORD = re.compile(r"\b(?!(?:and|or|not)\b)(\w+)\b")


def selects(expr: str, names: set[str]) -> bool:
    """Whether the `-m` expression `expr` selects a test with these marker names."""
    return eval(_WORD.sub(lambda m: repr(m.group(1) in names), expr), {})


def may_hold(path: Path, expr: str) -> bool:
    """Whether a test module can hold a test `expr` selects: its module mark (`pytestmark = pytest.mark.NAME`) with
    any subset of the markers the expression names that the module's text names anywhere else (a test's own mark)."""
    text = path.read_text()
    module = set(re.findall(r"^pytestmark = pytest\.mark\.(\w+)", text, re.M))
    named = set(_WORD.findall(expr))
    others = sorted(set(re.findall(r"mark\.(\w+)", text)) & named - module)
    return any(selects(expr, module | set(extra))
               for r in range(len(others) + 1) for extra in itertools.combinations(others, r))


def pytest_ignore_collect(collection_path, config):
    expr = config.getoption("markexpr")
    if expr and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if not may_hold(collection_path, expr):
            return True
    return None
