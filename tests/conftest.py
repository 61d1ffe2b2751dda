"""Test-wide settings: CPU, no persistent compilation cache unless asked for, and a deterministic hypothesis profile
(CI cannot flake; `make soak` runs the randomized long profile).

The suite runs in one process, where compiled steps are shared in memory anyway; writing each executable to JAX's
persistent cache buys nothing in a fresh CI clone. `GDN_JAX_TEST_COMPILE_CACHE=1` turns it on (folder .cache/jax)
for repeated local runs."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

if os.environ.get("GDN_JAX_TEST_COMPILE_CACHE") == "1":
    jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parent.parent / ".cache" / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
else:
    os.environ["GDN_JAX_CACHE_DIR"] = "off"  # engines built by the tests leave the cache off too

# "ci" (the default): derandomized, fixed example counts, no deadline. "soak": random seeds, many more examples.
settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None, print_blob=True)
settings.register_profile("soak", derandomize=False, deadline=None, print_blob=True, max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
