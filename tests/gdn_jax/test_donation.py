"""Donation holds: in every compiled step shape (decode and prefill, float32 and bfloat16) each state pool is updated
in place, inside the layer loop too. A copy or conversion of a pool would cost a pass over all of the engine's KV / GDN
memory per step."""

import math
import re

import jax
import pytest

from gdn_jax.engine import LLMEngine

# the engine group: every step shape, the CPU's forms; `make test` runs the xla_forms tests again with the CPU kernels
# off (XLA's forms): there a subset of the shapes, the ones that differ most
COMPILED, XLA_FORMS = pytest.mark.compiled, pytest.mark.xla_forms

# pools far larger than any activation of the tiny model, so a pool-sized temporary cannot hide among them
ENGINE_KW = dict(max_num_seqs=2, max_model_len=64, chunk_stride=32, num_kv_blocks=1024, num_linear_slots=1024,
                 verbose=False)


def _aliased_parameters(hlo: str) -> set[int]:
    """Parameter numbers the executable's outputs alias (its `input_output_alias` attribute)."""
    m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", hlo)
    return {int(p) for p in re.findall(r"\{[\d,]*\}: \((\d+),", m.group(1))} if m else set()


def _copied_sizes(hlo: str) -> list[int]:
    """Element counts of every `copy` instruction's result, in every computation."""
    sizes = []
    for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", hlo):
        sizes.append(math.prod(int(d) for d in dims.split(",")) if dims else 1)
    return sizes


def _layer_pools(state) -> list:
    """One layer's pool of each kind (the pools are stacked per kind: KV [kv_heads, layers, ...], GDN [layers, ...])."""
    return [state.k[:, 0], state.v[:, 0], state.conv[0], state.ssm[0]]


@COMPILED
@pytest.mark.slow  # compiles every bucket: ~30 s without the compilation cache
@pytest.mark.parametrize("dtype", ["float32"])  # bfloat16 (16-bit pools): the subset below, and the deterministic steps
def test_no_step_shape_copies_a_pool(dtype):
    worker = LLMEngine("tiny", dtype=dtype, **ENGINE_KW).worker
    shapes = worker.shape_buckets()
    # prefill rows up to max_model_len; shapes of 32 and 64 tokens also write checkpoints (checkpoint_mode "scan")
    assert {t for _, t, _ in shapes} == {1, 16, 32, 64} and {b for b, _, _ in shapes} == {1, 2}
    assert [worker.num_saves(b, t) for b in (1, 2) for t in (16, 32, 64)] == [0, 1, 2, 0, 2, 4]
    _assert_no_pool_copied(worker, shapes)


@XLA_FORMS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_and_the_most_saving_prefill_steps_copy_no_pool(dtype):
    """In XLA's forms (`make test` runs the xla_forms tests with the CPU kernels off): the one- and two-row decode
    steps and the prefill steps that write the most checkpoints (one row of 64 tokens, 2 saves; two rows, 4), of the
    grid whose every shape the test above checks in the CPU's forms."""
    worker = LLMEngine("tiny", dtype=dtype, **ENGINE_KW).worker
    shapes = [worker.step_shape(1, 1, False), worker.step_shape(2, 1, False), worker.step_shape(1, 64, True),
              worker.step_shape(2, 64, True)]
    assert set(shapes) <= set(worker.shape_buckets()) and [worker.num_saves(b, t) for b, t, _ in shapes] == [0, 0, 2, 4]
    _assert_no_pool_copied(worker, shapes)


def _assert_no_pool_copied(worker, shapes):
    pools = jax.tree.leaves(worker.state)
    first_pool = len(jax.tree.leaves(worker.params))  # the step's arguments: params, then the state
    # neither a whole stacked pool nor one layer's part of it (the layer loop indexes the stacks)
    pool_sizes = {p.size for p in pools + _layer_pools(worker.state)}
    for shape in shapes:
        compiled = worker.compiled_step(shape)
        hlo, mem = compiled.as_text(), compiled.memory_analysis()
        assert _aliased_parameters(hlo) == set(range(first_pool, first_pool + len(pools))), shape
        assert mem.alias_size_in_bytes == sum(p.nbytes for p in pools), shape
        assert not pool_sizes & set(_copied_sizes(hlo)), f"{shape}: a pool-sized copy"
        # nor any other temporary as large as one layer's pool (a dtype conversion of one, say)
        assert mem.temp_size_in_bytes < min(p.nbytes for p in _layer_pools(worker.state)), (shape, mem.temp_size_in_bytes)


@COMPILED
@XLA_FORMS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_unrolled_one_row_decode_step_updates_the_pools_in_place(monkeypatch, dtype):
    """GDN_JAX_UNROLL_LAYERS=decode: the one-row decode step (every layer traced with its index known) copies no pool
    either. It copied the GDN state pool once per GDN layer while XLA inlined the loop over its one row. (Block
    tables of a single attention chunk, max_model_len <= 256, still have a float32 value cache copied there: XLA
    hoists the chunk's gather out of the one-turn loop and fuses it with the token's write; not the case here.)"""
    monkeypatch.setenv("GDN_JAX_UNROLL_LAYERS", "decode")
    worker = LLMEngine("tiny", dtype=dtype, **(ENGINE_KW | dict(max_model_len=512))).worker
    pools = jax.tree.leaves(worker.state)
    hlo = worker.compiled_step(worker.step_shape(1, 1, False)).as_text()
    assert "conditional(" not in hlo  # unrolled: no switch over the layers
    assert not {p.size for p in pools + _layer_pools(worker.state)} & set(_copied_sizes(hlo))
