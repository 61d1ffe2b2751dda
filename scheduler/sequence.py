from array import array
from enum import Enum, auto

from scheduler.hashing import KV_DOMAIN, LINEAR_DOMAIN, domain_seed, extend_chain
from scheduler.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, progress, per-leaf cache handles and reuse metrics."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None):
        self.seq_id = seq_id
        self.token_ids = [int(t) for t in prompt_token_ids]  # prompt + generated
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.num_computed_tokens = 0
        self.lane = seq_id  # its request's lane of the waiting queue (`Scheduler.add`): a request's sequences share it

        # KV leaf: physical blocks covering positions [0, len(block_table) * block_size).
        self.block_table: list[int] = []
        self.num_kv_hashed_blocks = 0  # leading blocks already registered in the KV index
        # Linear leaf: the live slot this sequence advances (-1: none).
        self.linear_state_id = -1
        # Deferred save: chain hash of the chunk boundary just reached, saved next step.
        self.pending_save_hash: int | None = None
        self.pending_save_len = 0
        # "overlap" placement: the boundaries (in strides) its prefill saves, chosen at its first save (None: all)
        self.placed_boundaries: set[int] | None = None
        self.placement_chosen = False
        # Application hints: prompt positions (block boundaries, ascending) whose states become checkpoints
        self.checkpoint_positions: tuple[int, ...] = ()
        self.replaced_hash: int | None = None  # "end_of_turn": its last checkpoint at the end of its output so far

        # async scheduling: tokens a step in flight samples, not yet known (0 or 1): the next row computes one
        self.num_pending = 0
        self.draft_token_ids: list[int] = []  # speculative decoding: the MTP block's guesses of the next tokens
        self.num_draft_tokens = self.num_accepted_tokens = 0  # drafts verified, and accepted
        self._history = array("q")  # token_ids as C integers, as far as `history` has needed them

        # Two chained hash domains over the known tokens.
        self.block_hashes: list[int] = []  # stride block_size
        self.linear_state_hashes: list[int] = []  # stride chunk_stride

        # Reuse metrics, recorded at the first admission.
        self.kv_match = 0
        self.linear_reach = 0
        self.num_cached_tokens = 0
        self.reuse_lost = 0
        self.restored = False
        self.num_preemptions = 0
        self.num_admissions = 0
        # The most tokens computed in an admission that a preemption ended: the positions whose logits the request
        # has had (its prompt logprobs up to there are scored).
        self.max_num_computed_tokens = 0

    def check_hints(self, block_size: int) -> None:
        """`checkpoint_positions` must be ascending multiples of `block_size` within the prompt (ValueError)."""
        hints = list(self.checkpoint_positions)
        if hints != sorted(set(hints)) or any(not 0 < h <= self.num_prompt_tokens or h % block_size for h in hints):
            raise ValueError(f"request {self.seq_id}: checkpoint_positions must be ascending multiples of block_size "
                             f"({block_size}) within the prompt ({self.num_prompt_tokens} tokens), got {hints}")

    def sample(self, seq_id: int, sampling_params: SamplingParams) -> "Sequence":
        """A further sample of this sequence's prompt (n > 1), made before it has run: the prompt is copied, not
        converted token by token again, which for many samples of a long prompt was most of adding the request."""
        seq = Sequence(seq_id, (), sampling_params)
        seq.token_ids, seq.num_prompt_tokens = self.token_ids[:self.num_prompt_tokens], self.num_prompt_tokens
        return seq

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the single newest token is still to be computed."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    def update_block_hashes(self, block_size: int, fingerprint: str = "") -> None:
        if (len(self.block_hashes) + 1) * block_size > len(self.token_ids):
            return  # no new whole block
        extend_chain(self.block_hashes, self.token_ids, block_size,
                     domain_seed(KV_DOMAIN, block_size, fingerprint))

    def update_linear_state_hashes(self, chunk_stride: int, fingerprint: str = "") -> None:
        if (len(self.linear_state_hashes) + 1) * chunk_stride > len(self.token_ids):
            return  # no new whole chunk
        extend_chain(self.linear_state_hashes, self.token_ids, chunk_stride,
                     domain_seed(LINEAR_DOMAIN, chunk_stride, fingerprint))

    def history(self) -> array:
        """A copy of the tokens so far (prompt + output) as an array of C integers: the tokens added since the last
        call are converted, then the array is copied whole (a memory copy), so a decode step's history of a long
        context costs a copy, not a conversion of every token."""
        self._history.extend(self.token_ids[len(self._history):])
        return self._history[:]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def stop_reason(self, token: int, eos_token_id: int | None, max_model_len: int) -> str | None:
        """Why the sequence ends after appending `token` ("stop", "length"), or None."""
        sp = self.sampling_params
        if self.num_generated > sp.min_tokens:  # a stop token counts from output index min_tokens on
            if not sp.ignore_eos and token == eos_token_id:
                return "stop"
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return "stop"
        if sp.max_tokens is not None and self.num_generated >= sp.max_tokens or len(self.token_ids) >= max_model_len:
            return "length"
        return None
