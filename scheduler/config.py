from dataclasses import dataclass

from scheduler.eviction import EVICTION_POLICIES, PrefillCost
from scheduler.placement import PLACEMENTS

UNSAFE_REUSE_MODES = (None, "cold", "stale")
CHECKPOINT_MODES = ("scan", "promote")
CHECKPOINT_POLICIES = ("all", "last")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Everything the scheduler needs to size its pools and cut its steps.

    Slot and block id 0 are padding: usable KV blocks are [1, num_kv_blocks),
    usable linear-state slots are [1, num_linear_slots).
    """

    num_kv_blocks: int
    num_linear_slots: int = 0
    block_size: int = 16
    chunk_stride: int = 64
    max_num_seqs: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None  # prefill tokens per step; None: max(chunk_stride, 2048)
    enable_prefix_caching: bool = True
    has_linear_attention_layers: bool = True
    state_fingerprint: str = ""
    eos_token_id: int | None = None
    # Ablation only (never the default): reuse the whole KV match with a cold ("cold") or an earlier ("stale")
    # linear state. These are the two errors the cache exists to prevent; the accuracy study measures their drift.
    unsafe_reuse: str | None = None
    # How prefill checkpoints are taken. "scan" (default): a prefill row covers as many chunk strides as the token
    # budget allows, and the forward writes the state at every boundary the plan lists into a checkpoint slot of
    # its own, from the chunked scan's intermediate states. "promote" (the original design): a prefill row stops at
    # each boundary, and the next step promotes the live slot to a checkpoint and rotates the sequence into a copy.
    # Boundaries crossed while decoding are saved by promotion in both modes.
    checkpoint_mode: str = "scan"
    # Which boundaries a "scan" prefill row saves: "all" crossed, or only the "last" (deepest) one it reaches (fewer
    # slots and writes; a later prompt then reuses only from that depth, e.g. the next turn of a conversation).
    checkpoint_policy: str = "all"
    # "scan" mode: a step schedules the running decodes (one token each) first and fills the rest of the token budget
    # with prefill rows, so a long prompt no longer stalls the decodes while it prefills (vLLM v1's single budget).
    # False, and always with "promote": a step is all-prefill or all-decode, prefill first (the original design).
    mixed_steps: bool = True
    # With mixed_steps: a request none of whose sequences was admitted yet is admitted ahead of its turn, in a step
    # of its own (its first prefill, with no decode rows), and the next step is an ordinary one: a short request's
    # first token waits for no one else's prefill, as under a flood of samples.
    new_request_steps: bool = True
    # Sequences of one request (one lane of the waiting queue: `Scheduler.add`'s group, the server's HTTP request)
    # running at once (None: no bound but max_num_seqs). A request at its bound passes its turn to the others, and
    # forks only as many samples as it has room for; a step then holds fewer of its rows, which keeps a flood's steps
    # short where a step costs about in proportion to its rows (the CPU), at the cost of the flood's throughput.
    max_running_per_request: int | None = None
    # The engine plans the next step while the device runs this one, before this one's samples are known: a row's
    # token sampled by the step in flight is `PENDING_TOKEN` in the plan, which the worker takes from that step's
    # results on the device (`Scheduler.postprocess(ahead=True)`, `resolve`). Not with speculation.
    async_scheduling: bool = False
    # Which unpinned checkpoint an eviction takes (`scheduler.eviction`): the least recently used ("lru"), or the
    # least useful by Marconi's recency + alpha x FLOPs saved ("flop_aware"), the FLOPs from `prefill_cost`.
    checkpoint_eviction: str = "lru"
    eviction_alpha: float = 1.0
    prefill_cost: PrefillCost = PrefillCost()
    # Which boundaries a "scan" prefill row saves (`scheduler.placement`): every one it crosses ("stride"), or those
    # the observed shared-prefix lengths make most useful ("overlap"; with checkpoint_policy "all"); "end_of_turn":
    # "stride", and the states at the end of each prompt and of each output so far (at a KV block boundary).
    checkpoint_placement: str = "stride"
    # Checkpoints the host tier keeps after the device pool evicts them (`scheduler.host_tier`; 0: none)
    num_host_checkpoints: int = 0
    # The tier is the compressed one (`checkpoint_dtype`): every unpinned checkpoint moves there before a match, so
    # that every restore reads a compressed checkpoint and the device's slots hold only live states and the step's.
    offload_checkpoints: bool = False
    # Speculative decoding: drafts a decode row verifies per step (0: none). Each sequence then has this many draft
    # slots, which a verify step writes its state into after each draft (`scheduler.speculation`).
    num_speculative_tokens: int = 0

    def __post_init__(self):
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(self.chunk_stride, 2048))
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.chunk_stride < 1 or self.chunk_stride % self.block_size:
            raise ValueError(
                f"chunk_stride must be a positive multiple of block_size "
                f"({self.block_size}), got {self.chunk_stride}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_running_per_request is not None and self.max_running_per_request < 1:
            raise ValueError(f"max_running_per_request must be >= 1 or None, got {self.max_running_per_request}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.chunk_stride:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"chunk_stride ({self.chunk_stride})")
        # One sequence alone must always fit, or preemption could never make progress.
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if self.num_kv_blocks - 1 < blocks_per_seq:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) too small: one sequence of "
                f"max_model_len={self.max_model_len} needs {blocks_per_seq} blocks plus padding block 0")
        if self.has_linear_attention_layers and self.num_linear_slots <= self.max_num_seqs + self.num_draft_slots:
            raise ValueError(
                f"num_linear_slots ({self.num_linear_slots}): too few linear slots for max_num_seqs "
                f"({self.max_num_seqs}) and {self.num_draft_slots} draft slots; need more than both (slot 0 is "
                f"padding)")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.unsafe_reuse not in UNSAFE_REUSE_MODES:
            raise ValueError(f"unsafe_reuse must be one of {UNSAFE_REUSE_MODES}, got {self.unsafe_reuse!r}")
        if self.unsafe_reuse is not None and not self.enable_prefix_caching:
            raise ValueError("unsafe_reuse needs enable_prefix_caching=True: it is an ablation of the prefix cache")
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint_mode must be one of {CHECKPOINT_MODES}, got {self.checkpoint_mode!r}")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise ValueError(f"checkpoint_policy must be one of {CHECKPOINT_POLICIES}, got {self.checkpoint_policy!r}")
        if self.checkpoint_eviction not in EVICTION_POLICIES:
            raise ValueError(f"checkpoint_eviction must be one of {EVICTION_POLICIES}, got {self.checkpoint_eviction!r}")
        if self.checkpoint_placement not in PLACEMENTS:
            raise ValueError(f"checkpoint_placement must be one of {PLACEMENTS}, got {self.checkpoint_placement!r}")
        if self.checkpoint_placement == "overlap" and (self.checkpoint_mode, self.checkpoint_policy) != ("scan", "all"):
            raise ValueError(f"checkpoint_placement 'overlap' chooses the boundaries a \"scan\" prefill saves: it needs "
                             f"checkpoint_mode 'scan' and checkpoint_policy 'all', got {self.checkpoint_mode!r} and "
                             f"{self.checkpoint_policy!r}")
        if self.num_host_checkpoints < 0:
            raise ValueError(f"num_host_checkpoints must be >= 0, got {self.num_host_checkpoints}")
        if not self.eviction_alpha >= 0:
            raise ValueError(f"eviction_alpha must be >= 0, got {self.eviction_alpha}")
        if not isinstance(self.state_fingerprint, str):
            raise ValueError("state_fingerprint must be a str")

    @property
    def num_draft_slots(self) -> int:
        """Slots a verify step writes the states after each draft into: k per sequence (none without GDN layers)."""
        return self.num_speculative_tokens * self.max_num_seqs if self.has_linear_attention_layers else 0

    @property
    def prefix_caches_linear_state(self) -> bool:
        return self.has_linear_attention_layers and self.enable_prefix_caching
