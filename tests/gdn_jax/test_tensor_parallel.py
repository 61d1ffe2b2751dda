"""Tensor parallelism on forced host devices: the same tokens and logprobs as one device, the weights and pools
really split, nothing compiled after warm-up, and clear errors for sizes that do not divide."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from gdn_jax import LLM, SamplingParams
from gdn_jax.config import ModelConfig, get_preset
from gdn_jax.model import sharding
from gdn_jax.model.weights import hf_tensors
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.mesh

KW = dict(block_size=16, chunk_stride=32, max_num_seqs=4, max_model_len=192, verbose=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
HF_TINY = Path(__file__).resolve().parent.parent / "fixtures" / "hf_tiny"
# 8 attention and GDN value heads, 2 KV and GDN key heads: every head count divides tp=8, the key heads copied
WIDE = dataclasses.replace(get_preset("tiny-random"), num_attention_heads=8, linear_num_value_heads=8,
                           name="tiny-8-heads")


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if len(jax.devices()) < 8:
        pytest.fail("the mesh tests need 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (make test "
                    "sets it for the mesh group)")


def _prompts():
    rng = np.random.default_rng(5)
    system = random_ids(rng, 70)
    return [system + random_ids(rng, 9), random_ids(rng, 17), system + random_ids(rng, 30), random_ids(rng, 49)]


def _run(model, tp, params=GREEDY, ep=1, **kw):
    llm = LLM(model, tensor_parallel_size=tp, expert_parallel_size=ep, **{**KW, **kw})
    prompts = _prompts()  # the first alone: the third restores its checkpoints
    outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    return llm, [[(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for c in o.outputs]
                 for o in outs]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        for (gt, gl), (wt, wl) in zip(g, w, strict=True):
            assert gt == wt
            np.testing.assert_allclose(gl, wl, atol=1e-4)


@pytest.mark.parametrize("model, sizes", [("tiny-random", (4,)), (str(HF_TINY), (2,)), (WIDE, (8,))],
                         ids=["tiny-random", "transformers-checkpoint", "8-heads"])
def test_tensor_parallel_gives_the_one_device_tokens(model, sizes):
    """Greedy tokens equal and float32 logprobs within 1e-4 (the all-reduces sum in another order), the cache on,
    with restores (the first and third prompts share 70 tokens) and mixed steps."""
    _, want = _run(model, 1)
    for tp in sizes:
        llm, got = _run(model, tp)
        _assert_same(got, want)
        assert llm.cache_stats()["checkpoints_restored"] > 0


def test_forks_and_seeded_sampling_under_tensor_parallelism():
    """n=3 samples fork from their parent (prompts of 17 and 49 tokens, one past a block boundary), seeded: the
    same samples as on one device."""
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=6, logprobs=1, ignore_eos=True)
    one, want = _run("tiny-random", 1, params)
    two, got = _run("tiny-random", 2, params)
    _assert_same(got, want)
    assert two.cache_stats()["forks"] == one.cache_stats()["forks"] > 0


def test_weights_and_pools_are_split_over_the_devices():
    """Device 0 holds 1/tp of every split weight and pool (the sum of the addressable shards there), the norms
    whole; the memory plan is per device."""
    tp = 4
    llm = LLM("tiny-random", tensor_parallel_size=tp, **KW)
    worker, dev0 = llm.engine.worker, llm.engine.mesh.devices.flat[0]
    leaves = jax.tree_util.tree_leaves_with_path(worker.params)
    split = [x for _, x in leaves if x.ndim > 1 or x.shape[0] in (4, 8)]  # matrices, conv taps, per-head gates
    assert sharding.bytes_on_device(split, dev0) * tp == sum(x.nbytes for x in split)
    whole = [x for _, x in leaves if x.ndim == 1 and x.shape[0] not in (4, 8)]  # norms
    assert sharding.bytes_on_device(whole, dev0) == sum(x.nbytes for x in whole) > 0
    pools = [x for x in jax.tree_util.tree_leaves(worker.state)]
    assert len(pools) == 4 and sharding.bytes_on_device(pools, dev0) * tp == sum(x.nbytes for x in pools)
    memory = llm.engine.memory
    assert memory.devices == tp and "per device (the pools split 4 ways)" in memory.describe()
    assert memory.total_bytes == sharding.bytes_on_device(pools, dev0)


def test_no_compilation_after_warm_up_and_the_same_grid():
    kw = {**KW, "max_num_seqs": 2, "max_model_len": 96}  # a small grid: warm-up compiles every shape of it
    one = LLM("tiny-random", tensor_parallel_size=1, **kw)
    two = LLM("tiny-random", tensor_parallel_size=2, **kw)
    # the one-device grid, not compiled: warm-up compiles the worker's shape buckets and returns their number
    grid = one.engine.worker.shape_buckets()
    assert two.engine.worker.shape_buckets() == grid and two.warm_up() == len(grid) > 1
    before = two.engine.worker.num_compilations
    two.generate([p[:80] for p in _prompts()], GREEDY, use_tqdm=False)
    two.generate(_prompts()[:1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
    assert two.engine.worker.num_compilations == before


def test_sizes_that_do_not_divide_are_named():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM("tiny-random", tensor_parallel_size=3, **KW)
    odd = dataclasses.replace(get_preset("tiny-random"), num_attention_heads=6, num_key_value_heads=3,
                              linear_num_value_heads=6, linear_num_key_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 and num_key_value_heads=3"):
        sharding.tp_config(odd, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=16 x expert_parallel_size=1 needs 16 devices, "
                                         r"8 visible.*device_count=16"):
        LLM("tiny-random", tensor_parallel_size=16, **KW)
    with pytest.raises(ValueError, match="tensor-parallel layout"):
        hf_tensors(sharding.tp_config(get_preset("tiny-random"), 2), None)


def test_layout_keeps_each_shards_heads_together():
    """The interleaved rows of a fused projection: shard s's slice holds the s-th share of each part, and copies of
    the one KV head its query heads read."""
    cfg = get_preset("tiny-random")
    tp_cfg = sharding.tp_config(cfg, 4)  # 2 KV heads -> 4, one per shard
    H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = np.arange((2 * H + 2 * kvh) * hd)[:, None]  # each row's index in the HF order
    got = sharding.layout_tensor(cfg, tp_cfg, ("layers", 3, "self_attn", "qkv_proj", "kernel"), rows)[:, 0]
    shard = got.reshape(4, -1)[1]  # query head 1 (q and gate rows), a copy of KV head 0's k and v rows
    q = np.arange(2 * hd, 4 * hd)
    k = 2 * H * hd + np.arange(hd)
    assert shard.tolist() == [*q, *k, *(k + kvh * hd)]
    assert isinstance(tp_cfg, ModelConfig) and tp_cfg.num_key_value_heads == 4 and tp_cfg.layout_shards == 4


HF_TINY_MOE = HF_TINY.parent / "hf_tiny_moe"


def test_expert_parallelism_gives_the_unsplit_tokens():
    """EP of 2 and 4 with TP of 1 and 2 (with the cache-equivalence fixtures' EP=2 x TP=2, on tiny-random-moe): the
    same tokens and logprobs as one device, each device holding 1/EP of the experts' weights."""
    model = str(HF_TINY_MOE)
    _, want = _run(model, 1)
    for tp, ep in ((1, 2), (2, 4)):
        llm, got = _run(model, tp, ep=ep)
        _assert_same(got, want)
        worker = llm.engine.worker
        experts = [x for p, x in jax.tree_util.tree_leaves_with_path(worker.params)
                   if "experts_" in jax.tree_util.keystr(p)]
        assert len(experts) == 2 * worker.cfg.num_hidden_layers  # every layer of Qwen3.5-MoE is sparse
        on_device0 = sharding.bytes_on_device(experts, llm.engine.mesh.devices.flat[0])
        assert on_device0 * ep == sum(x.nbytes for x in experts)


def test_expert_parallel_sizes_are_checked():
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 does not divide num_experts=0 .*dense model"):
        LLM("tiny-random", expert_parallel_size=2, **KW)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide num_experts=8"):
        LLM("tiny-random-moe", expert_parallel_size=3, **KW)
