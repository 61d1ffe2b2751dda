"""A request's way out: each step's tokens recorded with their logprobs, decoded to text, cut at stop strings, and
built into RequestOutputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gdn_jax.engine.outputs import CompletionOutput, Logprob, LogprobRow, RequestMetrics, RequestOutput
from gdn_jax.worker.step import PromptLogprobs
from scheduler import Sequence


@dataclasses.dataclass
class RequestState:
    """What the engine keeps of a request while it runs: its samples, and the logprobs and text built so far."""

    request_id: str
    prompt: str | None
    seqs: list[Sequence]                               # one per sample; seqs[0] prefills, the others fork
    metrics: RequestMetrics
    logprobs: list[list[dict[int, Logprob]] | None]    # per sample
    cumulative_logprob: list[float]                    # per sample
    error: str | None = None                           # what the failed step raised, if one did
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_scored: int = 0                             # prompt positions up to here have their values (None: cached)
    texts: list[str] = dataclasses.field(default_factory=list)                # per sample, cut before a stop string
    stop_reasons: list[str | int | None] = dataclasses.field(default_factory=list)  # per sample
    # per sample: a stop string counts only if it ends past here (the end of the first min_tokens text, then of the
    # text already searched)
    stop_from: list[int] = dataclasses.field(default_factory=list)
    streams: list = dataclasses.field(default_factory=list)  # per sample: the tokenizer's incremental text decoder
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)  # shared by every output of the request
    final_only: bool = False  # an output only when it finishes (`LLM.generate` reads no other)
    # per sample: its CompletionOutput in the last output (None: not built yet), reused while the sample is unchanged
    built: list = dataclasses.field(default_factory=list)

    @property
    def seq(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def __post_init__(self):
        self._indices = {s.seq_id: i for i, s in enumerate(self.seqs)}

    def index(self, seq_id: int) -> int:
        return self._indices[seq_id]



class OutputProcessor:
    """Turns a step's results into each request's tokens, logprobs and text, and those into outputs."""

    def __init__(self, tokenizer, eos_token_id: int | None, abort: Callable[[int], None]):
        """`abort(seq_id)` ends a sample in the scheduler (a stop string found in its text)."""
        self.tokenizer, self.eos_token_id, self.abort = tokenizer, eos_token_id, abort

    def record_token(self, req: RequestState, index: int, token: int, result, row: int, now: float) -> None:
        """Sample `index`'s new token (row `row` of the step's `result`): its logprobs, and the request's first-token
        metrics on its first."""
        m, first, seq = req.metrics, req.seq, req.seqs[index]
        if m.first_token_time is None:
            m.first_token_time = now
            m.kv_match, m.linear_reach = first.kv_match, first.linear_reach
            m.num_cached_tokens, m.reuse_lost, m.restored = first.num_cached_tokens, first.reuse_lost, first.restored
        req.cumulative_logprob[index] += float(result.logprobs[row])
        k = seq.sampling_params.logprobs
        if k is not None:
            req.logprobs[index].append(self.logprob_entry(token, result.logprobs[row], result.ranks[row],
                                                          result.top_ids[row][:k], result.top_logprobs[row][:k]))

    def logprob_entry(self, token: int, logprob, rank: int, top_ids, top_logprobs) -> dict[int, Logprob]:
        """{token: its logprob and rank} plus the top entries (vLLM's convention: the actual token always)."""
        entry = {int(token): Logprob(float(logprob), int(rank))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
            entry.setdefault(int(tid), Logprob(float(lp), r))
        for tid, lp in entry.items():
            lp.decoded_token = self.decode_token(tid)
        return entry

    def decode_token(self, token_id: int) -> str:
        """One id's text alone, as vLLM shows a logprob's token: a special token's text kept."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_targets(self, req: RequestState, row) -> list[int] | None:
        """The prompt tokens this prefill row's logits score: positions start+1 .. min(end, prompt_len - 1), or None
        when none of them is new. After a preemption the prompt is prefilled again: the positions scored before keep
        their values (`record_prompt_logprobs`), the rest of the prompt is scored as it comes."""
        if req.prompt_logprobs is None or req.seq.seq_id != row.seq_id:
            return None  # samples forked from the prompt (n > 1) score nothing: the first one did
        lo, hi = row.start_pos + 1, min(row.start_pos + len(row.token_ids), req.seq.num_prompt_tokens - 1)
        return req.seq.token_ids[lo:hi + 1] if hi > req.prompt_scored and lo <= hi else None

    def record_prompt_logprobs(self, req: RequestState, start: int, targets: list[int], prompt: PromptLogprobs,
                               row: int) -> None:
        """The values of a prefill row's `targets` (prompt positions start+1 on) from row `row` of `prompt`."""
        k = req.seq.sampling_params.prompt_logprobs
        for t, token in enumerate(targets):
            if start + 1 + t <= req.prompt_scored:
                continue  # scored before a preemption: that value stands
            if k == -1:
                entry = LogprobRow(prompt.rows[row, t], self.decode_token)
            else:
                entry = self.logprob_entry(token, prompt.logprobs[row, t], prompt.ranks[row, t],
                                           prompt.top_ids[row, t, :k], prompt.top_logprobs[row, t, :k])
            req.prompt_logprobs[start + 1 + t] = entry
        req.prompt_scored = max(req.prompt_scored, start + len(targets))

    def update_text(self, req: RequestState, index: int, now: float) -> None:
        """Decodes sample `index` (its new tokens only: the stream keeps the rest). A sample that a stop token ended
        (EOS, or one of `stop_token_ids`: its `stop_reason`) leaves that token's text out, as vLLM does; the first
        stop string found ends the sample, and its text is cut before it (with `include_stop_str_in_output`: the
        stop token's text stays, and the text is cut after the stop string). As in vLLM, stop strings are looked for
        once more than `min_tokens` tokens are out, and only one that ends after the text of the first `min_tokens`
        counts (it may begin inside that text)."""
        seq, stream = req.seqs[index], req.streams[index]
        new = seq.token_ids[seq.num_prompt_tokens + stream.num_ids:]
        include = seq.sampling_params.include_stop_str_in_output
        if new and seq.finish_reason == "stop" and not isinstance(req.stop_reasons[index], str):
            token = seq.token_ids[-1]  # the scheduler ends a sample on the token that stops it
            new = new if include else new[:-1]
            if seq.sampling_params.ignore_eos or token != self.eos_token_id:
                req.stop_reasons[index] = token
        req.texts[index] = stream.add(new)
        stops = seq.sampling_params.stop
        if not stops or seq.finish_reason == "abort":
            return
        if seq.num_generated <= seq.sampling_params.min_tokens:
            req.stop_from[index] = len(req.texts[index])  # where the text of the first min_tokens tokens ends
            return
        hits = [(i, s) for s in stops
                if (i := req.texts[index].find(s, max(0, req.stop_from[index] - len(s) + 1))) >= 0]
        if hits:
            i, req.stop_reasons[index] = min(hits)
            req.texts[index] = req.texts[index][:i + len(req.stop_reasons[index]) if include else i]
            if not seq.is_finished:
                self.abort(seq.seq_id)  # frees its slots and blocks like any finish
                req.metrics.finished_time = now
            seq.finish_reason = "stop"
        elif getattr(stream, "appends_only", False):  # that text stays as it is: the next search starts past it
            req.stop_from[index] = max(req.stop_from[index], stream.num_chars)

    def visible_text(self, req: RequestState, index: int) -> str:
        """The text an unfinished sample can show without taking it back later: it holds back what later tokens may
        still change (the stream's `num_chars` end there: a trailing incomplete UTF-8 character, an open run of
        byte-fallback tokens) and the last (longest stop - 1) characters, which may begin a stop string."""
        seq = req.seqs[index]
        if seq.is_finished:
            return req.texts[index]
        text = req.texts[index][:req.streams[index].num_chars]
        stops = seq.sampling_params.stop
        return text[:max(0, len(text) - max(map(len, stops)) + 1)] if stops else text

    def make_output(self, req: RequestState, changed=None) -> RequestOutput:
        """The request's output so far (its final one once every sample finished). `changed`: the samples that
        changed since the last output (None: all); the others keep the CompletionOutput built then, which nothing
        modifies, so a step that advances a few of a request's many samples costs a few."""
        if len(req.built) != len(req.seqs):
            req.built, changed = [None] * len(req.seqs), None
        for i in range(len(req.seqs)) if changed is None else changed:
            seq, lps = req.seqs[i], req.logprobs[i]
            req.built[i] = CompletionOutput(i, self.visible_text(req, i), seq.output_token_ids,  # a fresh list
                                            req.cumulative_logprob[i] if lps is not None else None,
                                            list(lps) if lps is not None else None, seq.finish_reason,
                                            req.stop_reasons[i])
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, list(req.built),
                             req.is_finished, req.metrics.num_cached_tokens, req.metrics,
                             prompt_logprobs=req.prompt_logprobs, error=req.error)
