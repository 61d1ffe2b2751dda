"""The step plan: plain data handed from the scheduler to the worker."""
from dataclasses import dataclass, field

from scheduler.linear_cache import LinearStateCacheOp
from scheduler.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    seq_id: int
    token_ids: list[int]        # tokens computed this step (a prefill chunk, or 1 decode token)
    start_pos: int              # absolute position of token_ids[0] (= num_computed_tokens before the step)
    block_table: list[int]      # KV block ids covering positions [0, start_pos + len(token_ids))
    slot_mapping: list[int]     # per token: block_table[p // block_size] * block_size + p % block_size
    linear_op: LinearStateCacheOp | None   # None when the model has no GDN layers
    sample: bool                # True when this step's last token completes the known tokens, so a new token is sampled
    sampling_params: SamplingParams
    num_generated: int          # len(output_token_ids) before this step (the worker folds it into the seed)
    history: list[int] | None = None  # prompt + output so far, only for sampling rows that use penalties
    num_prompt_tokens: int = 0

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


@dataclass
class StepPlan:
    is_prefill: bool
    seqs: list[ScheduledSequence]
    saves: list[CheckpointSave] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
