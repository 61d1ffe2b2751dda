"""POST /v1/completions: one or more prompts, streamed or not, with logprobs and echo.

`echo` with `logprobs` scores the prompt from prompt logprobs. Positions served from the prefix cache have no logits,
so such a request is admitted with `skip_reading_prefix_cache`: it computes its whole prompt (reporting
`cached_tokens = 0`), while what it computes still populates the cache for other requests. With `max_tokens` 0 it
scores the prompt alone (the legacy API's scoring call): nothing generated, `completion_tokens` 0.

`logprobs` cover the tokens whose text the choice shows: not a stop string's tokens nor a stop token, and in a stream
a token's entry goes out with the chunk that shows the start of its text. `text_offset` counts characters of the
choice's text (a token that ends inside a multi-byte character puts the next one at that character's start). `n`
samples per prompt are choices i * n + j.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gdn_jax.engine import RequestOutput
from gdn_jax.entrypoints.openai.protocol import BadRequest, CompletionRequest, parse_body
from gdn_jax.entrypoints.openai.serving_engine import OpenAIServing, SampleStream, shown_tokens
from gdn_jax.tokenizer import text_offsets
from scheduler import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """The handler of /v1/completions."""

    def completion_prompts(self, req: CompletionRequest) -> list:
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)) or p == []:
            prompts = [p]
        else:
            prompts = list(p)
        if len(prompts) > self.config.max_prompts:
            raise BadRequest(f"at most {self.config.max_prompts} prompts per request, got {len(prompts)}", "prompt")
        return prompts

    def logprobs_block(self, ids: list[int], entries: list, offsets: list[int]) -> dict:
        """The completions API's logprobs object for `ids` (entries: per token a {id: Logprob} dict, or None;
        offsets: where each token's text begins in the choice's text, `TextOffsets`)."""
        dec = self.engine.decode_token
        tokens, lps, tops = [], [], []
        for t, entry in zip(ids, entries):
            tokens.append(dec(t))
            if entry is None:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(entry[t].logprob)
                tops.append({lp.decoded_token if lp.decoded_token is not None else dec(k): lp.logprob
                             for k, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": list(offsets)}

    def prompt_logprobs_block(self, out: RequestOutput, ids: list[int]) -> dict:
        """`logprobs_block` of an echoed prompt (its first token, and any position not computed, has None)."""
        return self.logprobs_block(ids, out.prompt_logprobs or [None] * len(ids),
                                   text_offsets(self.engine.tokenizer, ids))

    async def create_completion(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_auth(request)
        req = parse_body(CompletionRequest, await self.read_body(request))
        self.check_model(req)
        raw = self.completion_prompts(req)
        echo_lp = bool(req.echo) and req.logprobs is not None
        score_only = echo_lp and req.max_tokens == 0  # the legacy way to score a prompt: nothing generated
        prompts, params = [], None
        for prompt in raw:
            text, ids = self.validate_prompt(prompt, SamplingParams())
            params = self.sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs,
                                          req.logprobs if echo_lp else None, len(ids), score_only)
            self.check_request(ids, params)
            prompts.append((text if text is not None else self.engine.tokenizer.decode(ids), ids))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": self.config.model_name}
        sub = self.submit(prompts, params, arrival, req.checkpoint_positions)
        if req.stream:
            return self.stream_response(request, sub, head, self._completion_chunks(req, prompts, score_only),
                                        req.stream_options, score_only)
        finals: dict[int, RequestOutput] = {}
        async for i, out in self.outputs(request, sub):
            if out.finished:
                finals[i] = out
        if len(finals) < len(prompts):
            return Response(status_code=499)  # client gone
        tok, choices = self.engine.tokenizer, []
        for i in range(len(prompts)):  # choice i * n + j: sample j of prompt i
            out = finals[i]
            prompt_text, ids = prompts[i]
            base = len(prompt_text) if req.echo else 0
            pre = self.prompt_logprobs_block(out, ids) if req.echo and req.logprobs is not None else None
            for comp in out.outputs:
                text, lp = "" if score_only else comp.text, None
                if req.logprobs is not None:
                    offsets = text_offsets(tok, comp.token_ids, base)
                    n = 0 if score_only else shown_tokens(offsets, base + len(text), comp.finish_reason != "stop")
                    lp = self.logprobs_block(comp.token_ids[:n], comp.logprobs[:n], offsets[:n])
                    if pre is not None:
                        lp = {k: pre[k] + lp[k] for k in lp}
                choices.append({"index": len(choices), "text": prompt_text + text if req.echo else text,
                                "logprobs": lp, "finish_reason": "length" if score_only else comp.finish_reason,
                                "stop_reason": None if score_only else comp.stop_reason})
        return JSONResponse({**head, "choices": choices,
                             "usage": self.usage([finals[i] for i in sorted(finals)], score_only)})

    def _completion_chunks(self, req: CompletionRequest, prompts, score_only: bool):
        """Turns successive outputs of prompt i into streamed choices (one per sample j with news, index i * n + j).
        A token's logprobs go out with the chunk that shows the start of its text (`SampleStream`)."""
        streams: dict[tuple, SampleStream] = {}

        def one(i: int, j: int, out: RequestOutput) -> dict | None:
            comp = out.outputs[j]
            if (i, j) in streams and streams[i, j].unchanged(comp, out.finished):
                return None
            prompt_text, ids = prompts[i]
            prefix, lp = "", None
            if (i, j) not in streams:  # first chunk of this sample: the echoed prompt rides along
                streams[i, j] = SampleStream(self.engine.tokenizer, len(prompt_text) if req.echo else 0,
                                             req.logprobs is not None and not score_only)
                if req.echo:
                    prefix = prompt_text
                    if req.logprobs is not None:
                        lp = self.prompt_logprobs_block(out, ids)
            st = streams[i, j]
            new, fresh, shown = st.advance(comp, "" if score_only else comp.text, out.finished)
            if req.logprobs is not None:
                block = self.logprobs_block(comp.token_ids[shown], comp.logprobs[shown], st.offsets_of(shown))
                lp = block if lp is None else {k: lp[k] + block[k] for k in lp}
            if not (prefix or new or fresh or out.finished):  # a chunk per new token, even when its text is held
                return None
            return {"index": i * len(out.outputs) + j, "text": prefix + new, "logprobs": lp,
                    "finish_reason": ("length" if score_only else comp.finish_reason) if out.finished else None,
                    "stop_reason": comp.stop_reason if out.finished and not score_only else None}

        def delta(i: int, out: RequestOutput) -> list[dict]:
            return [c for j in range(len(out.outputs)) if (c := one(i, j, out)) is not None]

        return delta
