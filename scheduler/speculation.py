"""Speculative decoding's share of the scheduler: how many of a sequence's drafts its decode row verifies, the row
that verifies them, and what the step's outcome does to the sequence.

A verify row computes the last sampled token and the n drafts after it, at positions p .. p + n, and its forward
writes the GDN state after each of the first n positions into a draft slot of its own (`ScheduledSequence.
draft_slots`). The step samples at every position and keeps the drafts that match (`advance`): with a drafts accepted,
the sequence has computed p + a + 1 tokens, and its state there is the live slot's (a = n) or draft slot a's, which
then becomes the live slot (`LinearStateBlockManager.swap_draft_slot`); the KV of the positions past it is rolled
back by length. n stops one short of the next checkpoint boundary (`num_drafts`), so that a boundary is reached at
a row's last position, with every draft accepted, and saved from the live slot as any decode's (a row that jumped
over it would leave it unsaved); no checkpoint is taken inside a row.
"""
import dataclasses

from scheduler.plan import ScheduledSequence
from scheduler.sequence import Sequence


class Speculation:

    def __init__(self, config, block_manager):
        self.k = config.num_speculative_tokens
        self.config = config
        self.block_manager = block_manager
        # "end_of_turn" keeps states at KV block boundaries, every other placement at chunk_stride ones
        self.grid = config.block_size if config.checkpoint_placement == "end_of_turn" else config.chunk_stride
        self._free: list[int] = []  # the step's draft slots not yet handed out
        self.num_draft_tokens = self.num_accepted_tokens = 0  # drafts verified, and accepted, by all steps
        self.stopped: str | None = None  # why the sequence of the last `computed` row finished, if it did

    def begin_step(self) -> None:
        """Every step hands the draft slots out afresh: a step's rows take disjoint ones."""
        linear = self.block_manager.linear
        self._free = sorted(linear.draft_slots, reverse=True) if linear is not None else []

    def num_drafts(self, seq: Sequence) -> int:
        """Drafts `seq`'s next decode row verifies: its MTP drafts, none for a row whose sampling reads the history
        (penalties), and no more than the request may still emit (max_tokens, max_model_len) or than stop one short
        of the next checkpoint boundary."""
        sp, p = seq.sampling_params, seq.num_computed_tokens
        n = 0 if sp.uses_penalties else min(len(seq.draft_token_ids), self.k, self.config.max_model_len - p - 2)
        if sp.max_tokens is not None:
            n = min(n, sp.max_tokens - seq.num_generated - 1)
        if self.block_manager.saves_checkpoints:
            n = min(n, (p // self.grid + 1) * self.grid - p - 1)
        return max(n, 0)

    def reach(self, seq: Sequence, n: int | None = None) -> int:
        """KV positions `seq`'s verify row of `n` drafts (default `num_drafts`) needs: its own, and the k - 1 after
        them that the MTP block drafts at."""
        n = self.num_drafts(seq) if n is None else n
        return min(seq.num_computed_tokens + n + self.k, self.config.max_model_len)

    def row(self, seq: Sequence, row: ScheduledSequence) -> ScheduledSequence:
        """`seq`'s one-token decode row made its verify row: the drafts after the token, their positions, the block
        table up to `reach`, and a draft slot per draft."""
        n, bs, start = self.num_drafts(seq), self.config.block_size, seq.num_computed_tokens
        drafts = tuple(seq.draft_token_ids[:n])
        slots = tuple(self._free.pop() for _ in range(n)) if self.block_manager.linear is not None else ()
        table = seq.block_table[:-(-self.reach(seq, n) // bs)]
        mapping = [table[q // bs] * bs + q % bs for q in range(start, start + n + 1)]
        return dataclasses.replace(row, token_ids=row.token_ids + list(drafts), block_table=table, slot_mapping=mapping,
                                   sample=True, draft_token_ids=drafts, draft_slots=slots)

    def computed(self, seq: Sequence, row: ScheduledSequence, tokens: list[int] | None) -> int:
        """The tokens `row` computed and kept. A sampling row's samples (`tokens`: a verify row's are one more than
        the drafts it accepted) are appended to `seq` first, up to one that finishes it (the list is cut there, and
        `stopped` says why): the accepted drafts are computed positions, which the prefix cache hashes. A verify
        row keeps its first position and the drafts accepted, its state moved to the draft slot of the last of them
        when a draft was rejected."""
        self.stopped = None
        if not row.sample:
            return len(row.token_ids)
        if tokens is None:
            raise ValueError(f"row for seq {row.seq_id} samples but got no token")
        for j, t in enumerate(tokens):
            seq.append_token(t)
            if (reason := seq.stop_reason(t, self.config.eos_token_id, self.config.max_model_len)) is not None:
                self.stopped = reason
                del tokens[j + 1:]
                break
        if not row.draft_token_ids:
            return len(row.token_ids)
        accepted = len(tokens) - 1
        if accepted < len(row.draft_slots):
            self.block_manager.linear.swap_draft_slot(seq, row.draft_slots[accepted])
        seq.num_draft_tokens += len(row.draft_token_ids)
        seq.num_accepted_tokens += accepted
        self.num_draft_tokens += len(row.draft_token_ids)
        self.num_accepted_tokens += accepted
        return 1 + accepted
