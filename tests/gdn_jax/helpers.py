"""Small builders shared by the model tests: a one-row batch over a contiguous block table; prefill compile options;
the environment of a subprocess with caches of its own."""

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from gdn_jax.model.state import Batch
from gdn_jax.worker.compilation import compiler_options

BLOCK_SIZE = 16
# What the engine compiles its prefill steps with (on the CPU, the LLVM IR emitters): the tests' own jits of the model
# and its kernels compile with it too, as the engine would, and faster than with XLA's default emitters.
PREFILL_OPTIONS = compiler_options("prefill")
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hf_tiny"


def own_cache_env(**env) -> dict:
    """This process's environment for a subprocess whose engine keeps its caches where `env` says (GDN_JAX_CACHE_DIR),
    less the lane's JAX cache (tests/conftest.py), which the engine would take as the folder already configured."""
    lane = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    return {**{k: v for k, v in os.environ.items() if k not in lane}, **env}


def random_ids(rng, n) -> list[int]:
    """n byte-range token ids of the tiny vocabulary, clear of the special ids."""
    return rng.integers(4, 500, n).tolist()


def single_row_batch(tokens, start: int, num_blocks: int, slot: int = 1, warm: bool | None = None) -> Batch:
    """Row 0 owns KV blocks 1..num_blocks (block 0 is padding) and linear slot `slot`."""
    tokens = np.asarray(tokens, np.int32)
    pos = start + np.arange(len(tokens))
    return Batch(
        tokens=jnp.asarray(tokens)[None],
        start_pos=jnp.asarray([start], jnp.int32),
        lengths=jnp.asarray([len(tokens)], jnp.int32),
        block_tables=jnp.arange(1, num_blocks + 1, dtype=jnp.int32)[None],
        slot_mapping=jnp.asarray(pos + BLOCK_SIZE, jnp.int32)[None],
        linear_state_ids=jnp.asarray([slot], jnp.int32),
        has_initial_state=jnp.asarray([start > 0 if warm is None else warm]),
    )
