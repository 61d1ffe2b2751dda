"""The warm-up grid (`Worker.shape_buckets`) holds every step shape the scheduler's plans pad to, and no shape that
no plan can produce: a missing shape would compile while serving, an unreachable one costs a compilation at every
warm-up for nothing. The worker is built on abstract parameters: nothing is compiled here."""

import random

import jax.numpy as jnp
import pytest

from gdn_jax.config import EngineConfig, get_preset
from gdn_jax.model.weights import abstract_model
from gdn_jax.worker.worker import Worker
from gdn_jax.worker.memory import plan_memory
from scheduler import Scheduler, SchedulerConfig
from tests.scheduler.sched_helpers import FakeDevice, make_seq, submit

pytestmark = pytest.mark.startup

GEOMETRY = dict(block_size=4, chunk_stride=8, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64)


def _worker(checkpoint_mode: str) -> Worker:
    cfg = get_preset("tiny-random")
    graphdef, params = abstract_model(cfg, jnp.float32)
    settings = EngineConfig.create(**GEOMETRY, checkpoint_mode=checkpoint_mode)
    return Worker(cfg, graphdef, params, plan_memory(cfg, settings, 1 << 30), settings)


def _plan_shapes(checkpoint_mode: str, seed: int) -> set[tuple[int, int]]:
    """(rows, tokens) buckets of every step shape a random workload's plans run: waves of prompts of 1-200 tokens (some sharing a
    prefix) arriving while earlier ones still prefill or decode."""
    cfg = SchedulerConfig(**GEOMETRY, num_kv_blocks=1024, num_linear_slots=64, checkpoint_mode=checkpoint_mode)
    sched, dev, rng, worker = Scheduler(cfg), FakeDevice(cfg), random.Random(seed), _worker(checkpoint_mode)
    shared = [rng.randrange(7) for _ in range(120)]
    shapes, seq_id = set(), 0
    for wave in range(12):
        for _ in range(rng.randrange(1, 9)):
            seq_id += 1
            n = rng.choice([rng.randrange(1, 20), rng.randrange(1, 200)])
            prompt = (shared[:rng.randrange(len(shared))] if rng.random() < 0.3 else []) + \
                [rng.randrange(7) for _ in range(n)]
            submit(sched, dev, make_seq(seq_id, prompt, max_tokens=rng.randrange(1, 6)))
        for _ in range(rng.randrange(1, 40) if wave < 11 else 100_000):
            if not sched.has_unfinished():
                break
            plan = sched.schedule()
            # the worker runs a mixed plan as its prefill and its decode sub-batch, one step shape each
            for rows, prefill in ((plan.prefill_seqs, True), (plan.decode_seqs, False)):
                if rows:
                    longest = max(len(r.token_ids) for r in rows)
                    shapes.add((worker.rows_bucket(len(rows)), worker.tokens_bucket(longest, prefill)))
            sched.postprocess(plan, dev.execute(plan))
    assert not sched.has_unfinished()
    return shapes


@pytest.mark.parametrize("checkpoint_mode", ["scan", "promote"])
def test_every_planned_step_shape_is_in_the_warm_up_grid(checkpoint_mode):
    grid = {(b, t) for b, t, _ in _worker(checkpoint_mode).shape_buckets()}
    seen = set()
    for seed in range(6):
        seen |= _plan_shapes(checkpoint_mode, seed)
    assert seen <= grid, sorted(seen - grid)
    assert len(seen) >= len(grid) // 2  # the workload is varied enough for the check to mean something


def test_the_scan_grid_lists_exactly_the_buckets_a_plan_within_the_token_budget_can_reach():
    """rows x longest row <= max_num_batched_tokens (the scheduler's rule in "scan"): a bucket is listed iff some row
    count and longest row that pad to it satisfy it; with a budget of 64 and rows up to 8, e.g. 4 rows x 32 tokens
    (3 rows of 17+ tokens: 51) is listed, 2 x 64 (2 x 33), 4 x 64 (3 x 33) and 8 x 32 (5 x 17) are not."""
    worker = _worker("scan")
    budget, reached = GEOMETRY["max_num_batched_tokens"], set()
    for n in range(1, GEOMETRY["max_num_seqs"] + 1):
        for longest in range(1, budget + 1):
            if n == 1 or n * longest <= budget:
                reached.add((worker.rows_bucket(n), worker.tokens_bucket(longest)))
    grid = worker.shape_buckets()
    assert {(b, t) for b, t, _ in grid if t > 1} == reached
    assert {(1, 64), (4, 32), (8, 16)} <= reached and not {(2, 64), (4, 64), (8, 32)} & reached
    assert [s for s in grid if s[1] == 1] == [(b, 1, 128) for b in (1, 2, 4, 8)]  # decode: every rows bucket
