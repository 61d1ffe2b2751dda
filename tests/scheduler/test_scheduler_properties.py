"""Stateful property test: random arrivals from a small prefix tree, tight pools, random aborts.

The fake device holds every slot's recurrent state as the tokens folded into it and every KV entry
as the token written there, so each step checks exactness directly: a sequence only ever reads its
own prefix, and each checkpoint is keyed by the chain hash of exactly the tokens it holds.
"""
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler import Scheduler, SchedulerConfig
from tests.scheduler.sched_helpers import FakeDevice, make_seq

MAX_MODEL_LEN = 32
_rng = random.Random(7)
_ROOT = [_rng.randrange(4) for _ in range(MAX_MODEL_LEN)]
ROOTS = [_ROOT,
         _ROOT[:12] + [_rng.randrange(4) for _ in range(20)],
         _ROOT[:4] + [_rng.randrange(4) for _ in range(28)]]


class SchedulerMachine(RuleBasedStateMachine):

    @initialize(block_size=st.sampled_from([2, 4]), chunk_blocks=st.sampled_from([1, 2]),
                max_num_seqs=st.sampled_from([1, 2, 3, 4, 4]), extra_slots=st.integers(1, 4),
                extra_blocks=st.integers(0, 3), budget_chunks=st.integers(1, 3),
                has_linear=st.sampled_from([True, True, True, False]),
                caching=st.sampled_from([True, True, True, False]), eos=st.sampled_from([None, 0]),
                mode=st.sampled_from(["scan", "promote"]), policy=st.sampled_from(["all", "last"]),
                placement=st.sampled_from(["stride", "end_of_turn"]), host=st.sampled_from([0, 0, 1, 3]),
                offload=st.booleans(), per_request=st.sampled_from([None, None, 1, 2]))
    def setup(self, block_size, chunk_blocks, max_num_seqs, extra_slots, extra_blocks,
              budget_chunks, has_linear, caching, eos, mode, policy, placement, host, offload, per_request):
        chunk_stride = block_size * chunk_blocks
        self.config = SchedulerConfig(
            block_size=block_size, chunk_stride=chunk_stride,
            num_kv_blocks=MAX_MODEL_LEN // block_size + 1 + extra_blocks,
            num_linear_slots=max_num_seqs + extra_slots, max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=chunk_stride * budget_chunks,
            enable_prefix_caching=caching, has_linear_attention_layers=has_linear,
            eos_token_id=eos, state_fingerprint="prop", checkpoint_mode=mode, checkpoint_policy=policy,
            checkpoint_placement=placement, num_host_checkpoints=host, offload_checkpoints=offload and host > 0,
            max_running_per_request=per_request)
        self.sched = Scheduler(self.config)
        self.dev = FakeDevice(self.config)
        self.next_id = 0
        self.finished = []

    @rule(requests=st.lists(st.tuples(st.integers(0, len(ROOTS) - 1), st.integers(0, 24),
                                      st.lists(st.integers(0, 3), max_size=6), st.integers(1, 20),
                                      st.sets(st.integers(1, 8), max_size=3)),
                            min_size=1, max_size=4))
    def add_requests(self, requests):
        for root, k, suffix, max_tokens, hints in requests:
            tokens = (ROOTS[root][:k] + suffix) or [1]
            seq = make_seq(self.next_id, tokens, max_tokens=max_tokens)
            # application hints: block boundaries within the prompt, where its state becomes a checkpoint
            bs = self.config.block_size
            seq.checkpoint_positions = tuple(sorted(h * bs for h in hints if h * bs <= len(tokens)))
            self.next_id += 1
            self.sched.add(seq)
            self.dev.add(seq)

    @rule(root=st.integers(0, len(ROOTS) - 1), k=st.integers(1, 24), n=st.integers(2, 4),
          max_tokens=st.integers(1, 12))
    def add_group(self, root, k, n, max_tokens):
        """n samples of one prompt: forked from one prefill, or ordinary requests when a fork cannot happen."""
        seqs = [make_seq(self.next_id + i, ROOTS[root][:k], max_tokens=max_tokens) for i in range(n)]
        self.next_id += n
        self.sched.add(seqs[0], forks=seqs[1:])
        for seq in seqs:
            self.dev.add(seq)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            if self.sched.has_unfinished():
                self._step()

    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        ids = sorted(self.sched.seqs)
        if ids:
            assert self.sched.abort(ids[pick % len(ids)])

    def _step(self):
        sched, cfg = self.sched, self.config
        kv = sched.block_manager.kv
        kv_match = {}  # upper bound on what an admission this step may reuse
        for s in sched.waiting:
            s.update_block_hashes(cfg.block_size, cfg.state_fingerprint)
            kv_match[s.seq_id] = len(kv.match(s.token_ids, s.block_hashes)) * cfg.block_size
        plan = sched.schedule()
        assert plan is not None, "stalled with unfinished requests"
        sched.check_invariants()  # includes: in-flight restore sources are pinned checkpoints
        for row in plan.seqs:
            if row.seq_id not in kv_match:
                continue
            op = row.linear_op
            assert row.start_pos <= kv_match[row.seq_id]
            onloaded = {slot: h for h, slot in plan.onloads}  # a tier's entry copied into the row's live slot
            if op is not None and op.linear_state_id in onloaded:
                host = sched.block_manager.host
                # (a full tier may drop the entry later in the plan, after its copy; the device checks the state)
                assert not op.restore_requested and host.entries.get(onloaded[op.linear_state_id], row.start_pos) == (
                    row.start_pos) > 0
            elif cfg.prefix_caches_linear_state:
                index = sched.block_manager.linear.index
                # a stride boundary, or a sample's kept fork point: a checkpoint at a block boundary off the grid
                assert row.start_pos % cfg.chunk_stride == 0 or index.depth_of[op.restore_src_slot_id] == row.start_pos
                assert op.restore_requested and (op.restore_src_slot_id > 0) == (row.start_pos > 0)
            elif op is not None:
                assert (op.restore_requested, op.restore_src_slot_id) == (True, -1)
        sampled = self.dev.execute(plan)
        for seq in sched.postprocess(plan, sampled):
            assert seq.token_ids == self.dev.tokens[seq.seq_id]
            sp = seq.sampling_params
            if seq.finish_reason == "stop":
                assert seq.token_ids[-1] == cfg.eos_token_id
            else:
                assert seq.num_generated == sp.max_tokens or len(seq.token_ids) >= cfg.max_model_len
            self.finished.append(seq)

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()
            self.dev.check_checkpoints(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Generous: a drain needing more steps than this has stalled.
        bound = 4 * sum(len(s.token_ids) + s.sampling_params.max_tokens for s in self.sched.seqs.values())
        for _ in range(bound + 10):
            if not self.sched.has_unfinished():
                break
            self._step()
        assert not self.sched.has_unfinished(), "did not drain"
        self.sched.check_invariants()
        s, cfg = self.sched.stats(), self.config
        assert s["live_slots"] == 0
        if cfg.has_linear_attention_layers:
            assert s["free_slots"] + s["checkpoint_slots"] == cfg.num_linear_slots - 1
        assert s["kv_blocks_free"] == cfg.num_kv_blocks - 1


TestSchedulerProperties = SchedulerMachine.TestCase
# example count and randomness come from the profile (tests/conftest.py): fixed and derandomized in CI
TestSchedulerProperties.settings = settings(
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow])
