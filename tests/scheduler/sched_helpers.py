"""Test helpers: a fake device that checks every exactness guarantee, and small builders."""
from array import array

import xxhash

from scheduler import Scheduler, SchedulerConfig, Sequence, SamplingParams, chain_hashes, domain_seed

VOCAB = 7


def next_token(tokens: list[int], vocab: int = VOCAB) -> int:
    """Deterministic 'model': the next token depends only on the tokens so far."""
    return xxhash.xxh32_intdigest(array("q", tokens[-3:] + [len(tokens)]).tobytes()) % vocab


DEFAULT_MODE = "promote"  # set per test by tests/scheduler/conftest.py: every test runs in both modes


def small_config(**kw) -> SchedulerConfig:
    base = dict(block_size=4, chunk_stride=8, num_kv_blocks=64, num_linear_slots=16,
                max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, checkpoint_mode=DEFAULT_MODE)
    base.update(kw)
    return SchedulerConfig(**base)


class FakeDevice:
    """Executes plans on simulated pools and asserts the recurrent state and the KV it reads are
    exactly those of the sequence's own prefix.

    Linear slot state = the tuple of tokens folded into it; KV pool = (block, offset) -> token.
    """

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.state: dict[int, tuple] = {}
        self.kv: dict[tuple[int, int], int] = {}
        self.tokens: dict[int, list[int]] = {}  # the test's own view of every request
        self.restores = []  # (seq_id, start_pos, src) of warm restores
        self.host: dict[int, tuple] = {}  # the host tier: hash -> the state copied out
        self.num_tokens_computed = 0

    def add(self, seq: Sequence) -> None:
        self.tokens[seq.seq_id] = list(seq.token_ids)

    def execute(self, plan) -> list[int | None]:
        cfg, bs = self.config, self.config.block_size
        lives = [row.linear_op.linear_state_id for row in plan.seqs if row.linear_op is not None]
        assert len(set(lives)) == len(lives), "two rows advance one live slot"
        written = [s for row in plan.seqs for s in row.slot_mapping]
        assert len(set(written)) == len(written), "two tokens write one KV slot"
        # a mixed step runs its prefill rows, then its decode rows: a restore (a fork's) that read a live slot a decode
        # row advances would race that write (the worker refuses such a step)
        decode_lives = {row.linear_op.linear_state_id for row in plan.decode_seqs if row.linear_op is not None}
        # The host tier's copies first, as the engine makes them before the step.
        for op in plan.host_ops:
            if op[0] == "out":  # (the step may reuse the slot: it is read before)
                assert 0 < op[1] < cfg.num_linear_slots and op[2] not in self.host
                self.host[op[2]] = self.state[op[1]]
            elif op[0] == "drop":
                self.host.pop(op[1], None)  # (an offload a failed step was to make may be absent)
            else:
                assert op[0] == "in" and op[2] in lives  # into the live slot of the row that restores it
                self.state[op[2]] = self.host[op[1]]
        # Restores (all rows), as the jitted step does before the forward.
        new_state = {}
        for row in plan.seqs:
            op = row.linear_op
            if op is None or not op.restore_requested:
                continue
            assert 0 < op.linear_state_id < cfg.num_linear_slots
            if op.restore_src_slot_id == -1:
                new_state[op.linear_state_id] = ()
            else:
                assert 0 < op.restore_src_slot_id < cfg.num_linear_slots
                # a checkpoint is never live; a fork reads its parent's live slot before anything advances it
                assert op.fork or op.restore_src_slot_id not in lives, "restore source is a live slot"
                assert op.restore_src_slot_id not in decode_lives, "restore source is a live slot a decode row advances"
                new_state[op.linear_state_id] = self.state[op.restore_src_slot_id]
                self.restores.append((row.seq_id, row.start_pos, op.restore_src_slot_id))
        self.state.update(new_state)
        # checkpoints the step writes ("scan" mode): the row's state after `offset` of its tokens, into a slot no row
        # reads or advances in this step
        sources = {row.linear_op.restore_src_slot_id for row in plan.seqs if row.linear_op is not None}
        assert len({s.slot for s in plan.saves}) == len(plan.saves), "two saves write one slot"
        for save in plan.saves:
            assert plan.is_prefill and 0 <= save.row < len(plan.seqs)
            row = plan.seqs[save.row]
            assert save.slot not in lives and save.slot not in sources and 0 < save.slot < cfg.num_linear_slots
            assert 0 < save.offset <= len(row.token_ids) and save.boundary == row.start_pos + save.offset
            assert save.boundary % cfg.chunk_stride == 0
            self.state[save.slot] = tuple(self.tokens[row.seq_id][:save.boundary])
        out = []
        for row in plan.seqs:
            toks = self.tokens[row.seq_id]
            end = row.start_pos + len(row.token_ids)
            assert row.token_ids == toks[row.start_pos:end]
            assert 0 not in row.block_table and len(row.block_table) == -(-end // bs)
            for i, p in enumerate(range(row.start_pos, end)):
                assert row.slot_mapping[i] == row.block_table[p // bs] * bs + p % bs
                self.kv[(row.block_table[p // bs], p % bs)] = toks[p]
            for p in range(end):  # attention reads the whole prefix
                assert self.kv.get((row.block_table[p // bs], p % bs)) == toks[p], \
                    f"seq {row.seq_id} reads a wrong KV entry at position {p}"
            if cfg.has_linear_attention_layers:
                live = row.linear_op.linear_state_id
                assert self.state.get(live) == tuple(toks[:row.start_pos]), \
                    f"seq {row.seq_id}: recurrent state is not its prefix at {row.start_pos}"
                self.state[live] = tuple(toks[:end])
            else:
                assert row.linear_op is None
            self.num_tokens_computed += len(row.token_ids)
            if row.sample:
                assert end == len(toks)
                t = next_token(toks)
                toks.append(t)
                out.append(t)
            else:
                out.append(None)
        return out

    def check_checkpoints(self, sched: Scheduler) -> None:
        """Each checkpoint's key is the chain hash of exactly the tokens its slot holds: the linear chain at a stride
        boundary, the KV chain at a block boundary off the stride grid (a kept fork point)."""
        linear = sched.block_manager.linear
        if linear is None or linear.index is None:
            return
        cs, bs = self.config.chunk_stride, self.config.block_size
        seed = domain_seed("linear", cs, self.config.state_fingerprint)
        kv_seed = domain_seed("kv", bs, self.config.state_fingerprint)
        for h, slot in linear.index.slot_of.items():
            st = self.state[slot]
            assert len(st) > 0 and len(st) == linear.index.depth_of[slot]
            if len(st) % cs:
                assert len(st) % bs == 0 and chain_hashes(list(st), bs, kv_seed)[-1] == h
            else:
                assert chain_hashes(list(st), cs, seed)[-1] == h


def make_seq(seq_id: int, tokens, max_tokens: int = 4, **sp) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp))


def run(sched: Scheduler, device: FakeDevice, max_steps: int = 10_000, check: bool = True) -> list:
    """Step until everything finished; return the plans."""
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return plans
        plan = sched.schedule()
        assert plan is not None, "scheduler stalled with unfinished requests"
        plans.append(plan)
        sampled = device.execute(plan)
        if check:
            sched.check_invariants()
        sched.postprocess(plan, sampled)
        if check:
            sched.check_invariants()
            device.check_checkpoints(sched)
    raise AssertionError("did not finish")


def submit(sched: Scheduler, device: FakeDevice, seq: Sequence) -> Sequence:
    sched.add(seq)
    device.add(seq)
    return seq
