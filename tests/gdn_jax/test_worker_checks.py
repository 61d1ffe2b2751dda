"""The worker refuses, before anything is dispatched, a plan that would corrupt a state: a checkpoint save into a slot
the step reads or advances, two saves into one slot, a restore that reads a slot a decode row of the same mixed step
advances. The scheduler never plans one: these plans are built by hand."""

import numpy as np
import pytest

from gdn_jax import SamplingParams
from gdn_jax.config import EngineConfig, get_preset
from gdn_jax.model.qwen35 import init_model
from gdn_jax.worker.memory import plan_memory
from gdn_jax.worker.worker import Worker
from scheduler import LinearStateCacheOp, ScheduledSequence, StepPlan
from scheduler.plan import CheckpointSave
from tests.gdn_jax.helpers import random_ids

pytestmark = pytest.mark.engine

BS = 16


@pytest.fixture(scope="module")
def worker():
    """Scan mode at stride 16: a 32-token row crosses boundaries 16 and 32, and a (2 x 32) step has room for 4 saves."""
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    settings = EngineConfig.create(block_size=BS, chunk_stride=BS, max_num_seqs=2, max_model_len=64,
                                   max_num_batched_tokens=64, num_kv_blocks=16, num_linear_slots=8)
    w = Worker(cfg, graphdef, params, plan_memory(cfg, settings), settings)
    assert w.num_saves(2, 32) == 4
    return w


def _row(seq_id, start, n, table, op):
    tokens = random_ids(np.random.default_rng(seq_id), n)
    slots = [table[p // BS] * BS + p % BS for p in range(start, start + n)]
    return ScheduledSequence(seq_id, tokens, start, table, slots, op, True, SamplingParams(temperature=0.0), 0)


# row 0: cold from position 0 in live slot 1; row 1: restored at 16 from checkpoint slot 3 into live slot 2
COLD = _row(1, 0, 32, [1, 2], LinearStateCacheOp(1, True, -1))
WARM = _row(2, 16, 16, [3, 4], LinearStateCacheOp(2, True, 3))


def _saves(*slots):
    """A save at each boundary the two rows cross (16, 32 of row 0; 32 of row 1), into `slots`."""
    where = [(0, 16, 16), (0, 32, 32), (1, 16, 32)]
    return [CheckpointSave(row, offset, boundary, slot) for (row, offset, boundary), slot in zip(where, slots)]


def test_a_plan_with_saves_into_free_slots_passes_every_check(worker):
    worker._prepare(StepPlan(True, [COLD, WARM], _saves(4, 5, 6)), None)  # the host's side only: nothing runs


@pytest.mark.parametrize("slots, what", [((1, 5, 6), "row 0's live slot"), ((4, 2, 6), "row 1's live slot"),
                                         ((4, 5, 3), "row 1's restore source")])
def test_a_save_into_a_slot_the_step_advances_or_reads_is_refused(worker, slots, what):
    bad = next(i for i, (s, ok) in enumerate(zip(slots, (4, 5, 6))) if s != ok)
    with pytest.raises(ValueError, match=f"save {bad}: slot {slots[bad]} is out of range or read or advanced by "
                                         "this step"):
        worker.execute(StepPlan(True, [COLD, WARM], _saves(*slots)))


def test_two_saves_into_one_slot_are_refused(worker):
    with pytest.raises(ValueError, match="two checkpoint saves write the same slot"):
        worker.execute(StepPlan(True, [COLD, WARM], _saves(4, 5, 4)))


def test_a_mixed_step_refuses_a_fork_of_a_slot_its_decode_row_advances(worker):
    """A parent decodes in live slot 2 while its child forks slot 2: the child would read the parent's state before
    or after the decode, which runs in the second sub-batch. A save into the decode row's slot is refused too."""
    child = _row(3, 16, 2, [3, 5], LinearStateCacheOp(1, True, 2, fork=True))
    parent = _row(2, 17, 1, [3, 4], LinearStateCacheOp(2, False, -1))
    with pytest.raises(ValueError, match="row 0: restore_src_slot_id 2 is a live slot that a decode row of this "
                                         "mixed step advances"):
        worker.execute(StepPlan(True, [child, parent], num_decode_rows=1))
    cold = _row(1, 0, 32, [1, 5], LinearStateCacheOp(1, True, -1))
    with pytest.raises(ValueError, match="save into slot 2: a decode row of this mixed step reads or advances it"):
        worker.execute(StepPlan(True, [cold, parent], [CheckpointSave(0, 16, 16, 2)], num_decode_rows=1))
