"""Test-wide settings: CPU, the JAX persistent compilation cache (so repeated runs skip recompiles), and a
deterministic hypothesis profile (CI cannot flake; `make soak` runs the randomized long profile)."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

if not os.environ.get("GDN_JAX_TEST_NO_COMPILE_CACHE"):
    _CACHE = Path(__file__).resolve().parent.parent / ".cache" / "jax"
    jax.config.update("jax_compilation_cache_dir", str(_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

# "ci" (the default): derandomized, fixed example counts, no deadline. "soak": random seeds, many more examples.
settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None, print_blob=True)
settings.register_profile("soak", derandomize=False, deadline=None, print_blob=True, max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
