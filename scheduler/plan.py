"""The scheduler -> worker contract: plain, frozen data, built once by the scheduler and only read by the worker.

A `StepPlan` holds the step's rows (`ScheduledSequence`, one per scheduled sequence), each row's `LinearStateCacheOp`
(which live slot it advances and what is restored into it first), and the `CheckpointSave`s the step writes. The
names are the ones of the design: `linear_state_id` is a live slot, `restore_src_slot_id` a restore source.
"""
from array import array
from dataclasses import asdict, dataclass, field

from scheduler.sampling_params import SamplingParams

# A decode row's token that the step in flight samples (async scheduling): the worker takes it from that step's
# results on the device, so it never passes through the host.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class LinearStateCacheOp:
    """What a row does with the linear-state slot pool before its forward. Built once, when the scheduler has
    resolved both slots: the restore source is pinned before the live slot is taken, so nothing patches it later."""
    linear_state_id: int = -1        # live slot the sequence advances
    restore_requested: bool = False  # kept separate from the source id on purpose
    restore_src_slot_id: int = -1    # checkpoint slot to copy from (-1 with restore_requested: a cold start)
    fork: bool = False               # the source is the live slot of the sequence this one forks from (n > 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LinearStateCacheOp":
        return cls(linear_state_id=int(d["linear_state_id"]),
                   restore_requested=bool(d["restore_requested"]),
                   restore_src_slot_id=int(d["restore_src_slot_id"]),
                   fork=bool(d.get("fork", False)))

    @property
    def is_warm_restore(self) -> bool:
        """The step copies a source slot into the live slot (a checkpoint restore or a fork)."""
        return self.restore_requested and self.restore_src_slot_id > 0

    @property
    def restores_checkpoint(self) -> bool:
        """A warm restore from a checkpoint, pinned for the step (a fork reads a live slot and pins nothing)."""
        return self.is_warm_restore and not self.fork


@dataclass(frozen=True)
class ScheduledSequence:
    """One row of a step: a sequence's tokens computed this step and everything the worker needs to compute them."""
    seq_id: int
    token_ids: list[int]        # tokens computed this step (a prefill chunk, or 1 decode token)
    start_pos: int              # absolute position of token_ids[0] (= num_computed_tokens before the step)
    block_table: list[int]      # KV block ids covering positions [0, start_pos + len(token_ids))
    slot_mapping: list[int]     # per token: block_table[p // block_size] * block_size + p % block_size
    linear_op: LinearStateCacheOp | None   # None when the model has no GDN layers
    sample: bool                # True when this step's last token completes the known tokens, so a new token is sampled
    sampling_params: SamplingParams
    num_generated: int          # len(output_token_ids) before this step (the worker folds it into the seed)
    history: array | None = None  # prompt + output so far (C integers), only for sampling rows that use penalties
    num_prompt_tokens: int = 0
    next_token_id: int = -1     # the known token after token_ids (-1: none, the row samples it); the MTP block's input
    # speculative decoding: a verify row's drafts (token_ids[1:]), and the slots its state after each goes to
    draft_token_ids: tuple[int, ...] = ()
    draft_slots: tuple[int, ...] = ()

    @property
    def num_prompt_tokens_computed(self) -> int:
        """Prompt positions this row computes (a prefill chunk, or the last prompt token in a decode-shaped row)."""
        return max(0, min(self.start_pos + len(self.token_ids), self.num_prompt_tokens) - self.start_pos)


@dataclass(frozen=True)
class CheckpointSave:
    """A checkpoint the step writes ("scan" mode): the GDN state of row `row` after `offset` of its tokens (absolute
    position `boundary`, a chunk_stride boundary) goes to slot `slot`, indexed under the boundary's hash once the
    step completes."""
    row: int
    offset: int
    boundary: int
    slot: int


@dataclass(frozen=True)
class StepPlan:
    """One step: its rows and the checkpoint saves of a "scan" prefill. A step is all-decode (`is_prefill` False),
    all-prefill, or mixed: prefill rows first, then `num_decode_rows` one-token decode rows of running sequences
    (`mixed_steps`). Save rows index the prefill rows."""
    is_prefill: bool
    seqs: list[ScheduledSequence]
    saves: list[CheckpointSave] = field(default_factory=list)
    num_decode_rows: int = 0  # a prefill step's trailing decode rows (0 unless mixed)
    # the host tier's copies and drops (`scheduler.host_tier`), in this order, before anything else of the step:
    # ("out", slot, hash) a slot's checkpoint to the host, ("drop", hash), ("in", hash, slot) an entry into a slot
    host_ops: list[tuple] = field(default_factory=list)

    @property
    def onloads(self) -> list[tuple[int, int]]:
        """(hash, slot) of every host entry the step copies into a slot."""
        return [op[1:] for op in self.host_ops if op[0] == "in"]

    def __post_init__(self):
        if not 0 <= self.num_decode_rows <= (len(self.seqs) if self.is_prefill else 0):
            raise ValueError(f"num_decode_rows={self.num_decode_rows} for a step of {len(self.seqs)} rows "
                             f"(is_prefill={self.is_prefill})")

    @property
    def num_prefill_rows(self) -> int:
        return len(self.seqs) - self.num_decode_rows if self.is_prefill else 0

    @property
    def is_mixed(self) -> bool:
        return self.is_prefill and self.num_decode_rows > 0

    @property
    def prefill_seqs(self) -> list[ScheduledSequence]:
        return self.seqs[:self.num_prefill_rows]

    @property
    def decode_seqs(self) -> list[ScheduledSequence]:
        return self.seqs[self.num_prefill_rows:]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
