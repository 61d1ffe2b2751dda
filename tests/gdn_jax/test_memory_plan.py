"""Pool sizing: bytes per KV block and per linear slot, explicit counts, and the memory budget."""

import pytest

from gdn_jax.config import EngineConfig, get_preset
from gdn_jax.worker.memory import CHECKPOINTS_PER_SEQ_MAX, CPU_MEMORY_BUDGET_BYTES, default_memory_budget, plan_memory

pytestmark = pytest.mark.engine


def _settings(dtype: str, max_num_seqs: int, max_model_len: int, **cache) -> EngineConfig:
    return EngineConfig.create(dtype=dtype, block_size=16, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               **cache)


def test_qwen35_9b_bytes_per_block_and_slot():
    cfg = get_preset("qwen3.5-9b")
    plan = plan_memory(cfg, _settings("bfloat16", 8, 4096), 40 << 30)
    # 8 full-attention layers x (K and V) x 16 tokens x 4 kv heads x 256 dims x 2 bytes
    assert plan.bytes_per_kv_block == 8 * 2 * 16 * 4 * 256 * 2
    # 24 GDN layers x (conv: 3 x (2*16*128 + 32*128) channels x 2 bytes + SSM: 32 heads x 128 x 128 x 4 bytes)
    assert plan.bytes_per_linear_slot == 24 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert plan.total_bytes <= 40 << 30
    assert plan.num_linear_slots == 1 + 8 + 8 * 8   # live slots plus checkpoints, capped at 8 per sequence


def test_explicit_counts_win_and_a_small_budget_shrinks_the_pools():
    cfg = get_preset("tiny-random")
    explicit = plan_memory(cfg, _settings("float32", 4, 256, num_kv_blocks=33, num_linear_slots=9), 1 << 20)
    assert (explicit.num_kv_blocks, explicit.num_linear_slots) == (33, 9)
    roomy = plan_memory(cfg, _settings("float32", 4, 256), 1 << 30)
    small = plan_memory(cfg, _settings("float32", 4, 256), 1 << 20)
    assert roomy.num_kv_blocks == 1 + 2 * 4 * 16           # enough for full concurrency, twice
    assert small.num_kv_blocks < roomy.num_kv_blocks and small.total_bytes <= 1 << 20
    assert small.num_linear_slots > 4                       # always one live slot per sequence


def test_the_default_plan_reserves_a_checkpoint_per_sequence_even_for_qwen35_9b():
    cfg = get_preset("qwen3.5-9b")
    plan = plan_memory(cfg, _settings("bfloat16", 16, 4096), CPU_MEMORY_BUDGET_BYTES)
    assert plan.num_checkpoint_slots >= 16 and plan.num_linear_slots == 1 + 16 + plan.num_checkpoint_slots
    assert plan.total_bytes <= CPU_MEMORY_BUDGET_BYTES and plan.num_kv_blocks >= 1 + 4096 // 16
    assert "1 padding + 16 live + " in plan.describe() and "checkpoint" in plan.describe()
    # without prefix caching no checkpoint room is kept
    off = plan_memory(cfg, _settings("bfloat16", 16, 4096, enable_prefix_caching=False), CPU_MEMORY_BUDGET_BYTES)
    assert off.num_checkpoint_slots == 0 and off.num_kv_blocks > plan.num_kv_blocks


def test_a_budget_too_small_for_the_minimum_names_the_linear_state_slots():
    cfg = get_preset("qwen3.5-9b")
    with pytest.raises(ValueError, match=r"33 linear-state slots x 49\.12 MiB"):
        plan_memory(cfg, _settings("bfloat16", 16, 4096), 1 << 30)
    with pytest.raises(ValueError, match="no room for a checkpoint"):
        plan_memory(cfg, _settings("bfloat16", 16, 4096, num_linear_slots=17), 40 << 30)


def test_more_budget_buys_more_checkpoints_up_to_the_cap():
    cfg = get_preset("tiny-random")
    counts = [plan_memory(cfg, _settings("float32", 4, 256), b).num_checkpoint_slots
              for b in (1 << 19, 1 << 20, 1 << 30)]
    assert counts[0] >= 4 and counts == sorted(counts) and counts[-1] == CHECKPOINTS_PER_SEQ_MAX * 4


class _Accelerator:
    """A device as a GPU reports itself: `memory_stats()` with XLA's allocator limit (by default 75% of the GPU's
    memory, XLA_PYTHON_CLIENT_MEM_FRACTION) and the bytes in use."""

    platform = "gpu"

    def __init__(self, limit: int, in_use: int):
        self.limit, self.in_use = limit, in_use

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": self.in_use, "peak_bytes_in_use": self.in_use}


def test_the_accelerator_budget_is_each_engines_share_beside_what_the_process_holds():
    """On a GPU the budget is this engine's share of what XLA may allocate, less its weights (on the device already):
    per engine, as vLLM's `gpu_memory_utilization` is per instance, so two engines of one process (cache on and off
    side by side, as the studies build them) fit at 0.45 each. A share that does not fit beside what other engines
    hold is refused naming both, not left to fail in XLA's allocator."""
    gib = 1 << 30
    assert default_memory_budget(10 * gib, 0.9, _Accelerator(100 * gib, 10 * gib)) == 80 * gib
    assert default_memory_budget(10 * gib, 0.45, _Accelerator(100 * gib, 10 * gib)) == 35 * gib
    # a second engine: the first's 10 GiB of weights and 35 GiB of pools are held, its own 10 GiB loaded
    assert default_memory_budget(10 * gib, 0.45, _Accelerator(100 * gib, 55 * gib)) == 35 * gib
    with pytest.raises(ValueError, match=r"asks for 90\.00 GiB of the 100\.00 GiB .* 45\.00 GiB of it are held"):
        default_memory_budget(10 * gib, 0.9, _Accelerator(100 * gib, 55 * gib))
    assert default_memory_budget(10 * gib, 0.9, type("Cpu", (), {"platform": "cpu"})()) == (
        CPU_MEMORY_BUDGET_BYTES)


def test_an_accelerator_that_reports_no_limit_warns_and_gets_the_cpu_budget():
    """A GPU whose allocator reports no limit (XLA_PYTHON_CLIENT_ALLOCATOR=platform): the CPU's budget, with a
    warning that says how to size the pools, not silently."""
    device = type("Gpu", (), {"platform": "gpu", "memory_stats": lambda self: None})()
    with pytest.warns(RuntimeWarning, match="reports no memory limit.*memory_budget_bytes"):
        assert default_memory_budget(1 << 30, 0.9, device) == CPU_MEMORY_BUDGET_BYTES


def test_an_accelerator_without_room_names_xla_s_share_of_the_device():
    """XLA's allocator may use `bytes_limit`, by default 75% of the GPU: the error says so and names the variable
    that raises it, not "the device's" memory (a 24 GB GPU reported as 18 GiB)."""
    gib = 1 << 30
    with pytest.raises(ValueError, match=r"18\.00 GiB XLA may allocate.*XLA_PYTHON_CLIENT_MEM_FRACTION"):
        default_memory_budget(17 * gib, 0.9, _Accelerator(18 * gib, 17 * gib))


@pytest.mark.parametrize("pools", [{}, {"num_kv_blocks": 64, "num_linear_slots": 40}])
def test_gpu_memory_utilization_out_of_range_is_refused_even_when_no_budget_is_asked(pools):
    """An engine given both pool counts asks for no budget, but a gpu_memory_utilization outside (0, 1] is still a
    bad argument, refused as vLLM refuses it, not silently accepted."""
    from gdn_jax.engine import LLMEngine

    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1\.5"):
        LLMEngine("tiny-random", max_num_seqs=4, max_model_len=128, gpu_memory_utilization=1.5, verbose=False,
                  **pools)


@pytest.mark.parametrize("preset", ["tiny-random", "tiny-random-moe"])
def test_prefill_flops_count_every_matrix_a_token_meets(preset):
    """`ModelConfig.prefill_flops` (the FLOP-aware eviction's cost) against the model's own parameters: 2 FLOPs per
    weight of every matrix and conv tap a token meets (of an MoE layer's experts, the k it routes to), the GDN
    rule's 4 products per state element, and per (query, key) pair 4 H hd in each full-attention layer."""
    from flax import nnx
    from gdn_jax.model.qwen35 import init_model
    from gdn_jax.model_config import get_preset

    cfg = get_preset(preset)
    _, params = init_model(cfg)
    flat = {"/".join(str(k) for k in path): a for path, a in nnx.to_flat_state(params)}
    weights = 0
    for name, a in flat.items():
        if name.startswith(("embed_tokens", "lm_head")) or a.ndim < 2:
            continue
        weights += a.size * cfg.num_experts_per_tok // cfg.num_experts if "experts" in name else a.size
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    linear, quadratic = cfg.prefill_flops()
    assert linear == 2 * weights + 2 * 4 * state * len(cfg.linear_layer_ids)
    assert quadratic == 4 * cfg.num_attention_heads * cfg.head_dim * len(cfg.full_layer_ids)
