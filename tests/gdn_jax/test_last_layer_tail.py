"""The deferred last layer of a sampling step (`Qwen35Model.last_layer_tail`) against the whole-chunk forward.

In the engine group, compiled with XLA's default options: its claim that both programs leave the states bitwise the
same holds for the code XLA emits with its optimisations on (`make test` compiles the model group without them)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.config import FULL, LINEAR, get_preset, hybrid_layer_types
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import Batch, init_state
from tests.gdn_jax.helpers import BLOCK_SIZE, PREFILL_OPTIONS

pytestmark = pytest.mark.compiled


@pytest.fixture(scope="module")
def step():
    return jax.jit(forward, static_argnums=(0, 4), compiler_options=PREFILL_OPTIONS)


def _two_chunk_batches(rng, T: int = 40):
    """Two steps of a 3-row batch: rows of 37 and 21 prompt tokens and a padding row (lengths 0, garbage tokens),
    then their next 17 and 6 tokens on top (warm, positions 37 and 21 on). Row r owns blocks 1 + 5r .. 5 + 5r and
    linear slot r + 1."""
    steps, starts = [], np.zeros(3, np.int32)
    for lengths in (np.array([37, 21, 0], np.int32), np.array([17, 6, 0], np.int32)):
        tokens = rng.integers(2, 500, (3, T)).astype(np.int32)
        pos = starts[:, None] + np.arange(T)[None, :]
        tables = 1 + 5 * np.arange(3)[:, None] + np.arange(5)[None, :]
        slot_map = np.where(np.arange(T)[None, :] < lengths[:, None],
                            tables[np.arange(3)[:, None], pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, 0)
        tables[2] = 0
        steps.append(Batch(tokens=jnp.asarray(tokens), start_pos=jnp.asarray(starts), lengths=jnp.asarray(lengths),
                           block_tables=jnp.asarray(tables), slot_mapping=jnp.asarray(slot_map.astype(np.int32)),
                           linear_state_ids=jnp.asarray([1, 2, 0], jnp.int32),
                           has_initial_state=jnp.asarray(starts > 0)))
        starts = starts + lengths
    return steps


_LAYOUTS = [
    hybrid_layer_types(8),            # the last layer inside the loop: a switch on its index
    hybrid_layer_types(4),            # one group, no loop: the last layer known when traced
    (LINEAR, FULL, LINEAR, LINEAR),   # a GDN layer last
    (FULL, FULL, FULL),
]


# every layout in float32; bfloat16 (the same code, its own rounding) in the engine's layout of several groups
@pytest.mark.parametrize("dtype, layer_types", [("float32", t) for t in _LAYOUTS] + [("bfloat16", _LAYOUTS[0])],
                         ids=lambda x: "".join("G" if y == LINEAR else "A" for y in x) if isinstance(x, tuple) else x)
def test_sampling_step_finishes_the_last_layer_at_the_last_tokens_only(layer_types, dtype, step):
    """A step that samples computes the last layer's attention output and MLP at each row's last token only
    (`Qwen35Model.last_layer_tail`): its logits are those of the whole-chunk forward there (to the dtype's rounding:
    the one-row products sum in another order), its caches and states bitwise the same, for a cold and a warm chunk,
    a padding row among them."""
    cfg = dataclasses.replace(get_preset("tiny-random"), layer_types=layer_types)
    graphdef, params = init_model(cfg, dtype=jnp.dtype(dtype))
    state_last = state_all = init_state(cfg, 16, BLOCK_SIZE, 4, jnp.dtype(dtype))
    # worst seen: float32 6.0e-7 (scripts/tools/tolerance_audit.py; the CPU kernels on and off), bfloat16 4.9e-3 on logits
    # of magnitude ~1.2
    atol = {"float32": 2.5e-6, "bfloat16": 2e-2}[dtype]
    for batch in _two_chunk_batches(np.random.default_rng(5)):
        logits, state_last = step(graphdef, params, batch, state_last, False)
        every, state_all = step(graphdef, params, batch, state_all, True)
        at_last = np.asarray(every)[np.arange(3), np.maximum(np.asarray(batch.lengths) - 1, 0)]
        np.testing.assert_allclose(np.asarray(logits)[:2], at_last[:2], atol=atol, rtol=0)
        assert np.isfinite(np.asarray(logits)).all()
        for a, b in zip(jax.tree.leaves(state_last), jax.tree.leaves(state_all)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if layer_types == hybrid_layer_types(4) and dtype == "float32":
        # The last layer outside any loop (XLA counts its work once): all positions' logits cost the LM head at every
        # other position, and the sampling step also saves the last layer's MLP there.
        flops = []
        for every in (False, True):
            cost = step.lower(graphdef, params, batch, state_all, every).compile().cost_analysis()
            flops.append((cost[0] if isinstance(cost, list) else cost)["flops"])
        others = batch.tokens.size - batch.tokens.shape[0]
        D = cfg.hidden_size
        assert flops[1] - flops[0] >= 2 * others * (cfg.vocab_size * D + 3 * D * cfg.intermediate_size)
