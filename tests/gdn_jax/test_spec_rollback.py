"""The primitive that speculative decoding's rollback rests on: a verify step of k + 1 tokens, run as a prefill row with
the chunked rule's chunk size 1, or as the engine runs it, on the one-token forms position by position, saves the GDN
state after each of its positions into slots of their own; each saved state, and each position's logits, equal those
of decoding the same tokens one at a time. A rejected draft then costs no recomputation: the row's live state becomes
the slot of its last accepted position."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.backends.cpu import tuning
from gdn_jax.config import get_preset
from gdn_jax.model.forms import GENERIC
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import init_state
from tests.gdn_jax.helpers import BLOCK_SIZE, random_ids, single_row_batch

pytestmark = pytest.mark.startup  # (a forward of the model: beside the MTP block's tests)

NB = 4  # KV blocks of the row: 64 positions


def _copy(state):
    return type(state)(*(None if a is None else jnp.array(a) for a in dataclasses.astuple(state)))


# the chunked rule's two schedules, and the engine's verify step: the one-token forms position by position
@pytest.mark.parametrize("schedule", ["auto", "parallel", "by_position"])
def test_a_verify_step_saves_the_state_after_each_position_as_decoding_one_by_one_does(schedule):
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    forms = tuning.resolve_forms("float32") if schedule == "by_position" else GENERIC  # (the engine's, kernels and all)
    rng = np.random.default_rng(3)
    prompt, verify = random_ids(rng, 21), random_ids(rng, 4)  # the last token and k = 3 drafts
    state = init_state(cfg, NB + 1, BLOCK_SIZE, 8)
    _, state = forward(graphdef, params, single_row_batch(prompt, 0, NB), state)
    before = _copy(state)

    batch = dataclasses.replace(single_row_batch(verify, len(prompt), NB), save_rows=jnp.zeros(3, jnp.int32),
                                save_offsets=jnp.arange(1, 4, dtype=jnp.int32),
                                save_slots=jnp.arange(2, 5, dtype=jnp.int32))
    logits, after = forward(graphdef, params, batch, _copy(before), all_logits=True, chunk_size=1,
                            gdn_schedule="auto" if schedule == "by_position" else schedule, forms=forms,
                            by_position=schedule == "by_position")

    one = before
    for i, token in enumerate(verify):
        step_logits, one = forward(graphdef, params, single_row_batch([token], len(prompt) + i, NB), one, forms=forms)
        np.testing.assert_allclose(np.asarray(logits[0, i]), np.asarray(step_logits[0]), atol=2e-4, rtol=0,
                                   err_msg=f"logits at verify position {i}")
        slot = 2 + i if i < 3 else 1  # the saves after 1, 2, 3 tokens; the live slot after all 4
        for layer in range(len(cfg.linear_layer_ids)):
            np.testing.assert_allclose(np.asarray(after.ssm[layer, slot]), np.asarray(one.ssm[layer, 1]), atol=1e-5,
                                       rtol=0, err_msg=f"recurrent state after {i + 1} tokens, GDN layer {layer}")
            # (the conv state is the input projection's output: a product over 4 rows against one, summed in another
            # order where XLA compiles without LLVM's optimisation, as `make test`'s group does: 1.04e-6 seen)
            np.testing.assert_allclose(np.asarray(after.conv[layer, slot]), np.asarray(one.conv[layer, 1]), atol=4e-6,
                                       rtol=0, err_msg=f"conv state after {i + 1} tokens, GDN layer {layer}")
