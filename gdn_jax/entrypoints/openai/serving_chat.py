"""POST /v1/chat/completions: a conversation rendered with the model's chat template, streamed or not.

Logprobs (`logprobs` / `top_logprobs`) cover the tokens whose text the reply shows, as in /v1/completions. With a
reasoning parser the reply's think block is the message's `reasoning`, the rest its `content` (`reasoning`).
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gdn_jax.chat import ChatTemplate, chat_message, chat_modes
from gdn_jax.engine import RequestOutput
from gdn_jax.entrypoints.openai.engine_loop import EngineLoop
from gdn_jax.entrypoints.openai.protocol import BadRequest, ChatRequest, parse_body
from gdn_jax.entrypoints.openai.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from gdn_jax.entrypoints.openai.server_config import ServerConfig
from gdn_jax.entrypoints.openai.serving_engine import GracefulShutdown, OpenAIServing, SampleStream, shown_tokens
from gdn_jax.tokenizer import text_offsets
from scheduler import SamplingParams


class OpenAIServingChat(OpenAIServing):
    """The handler of /v1/chat/completions; without a chat template it answers 400."""

    def __init__(self, loop: EngineLoop, config: ServerConfig, shutdown: GracefulShutdown | None = None):
        super().__init__(loop, config, shutdown)
        self.template = ChatTemplate(config.chat_template, config.special_tokens) if config.chat_template else None

    def chat_logprobs(self, ids: list[int], entries: list, k: int) -> dict:
        """The chat API's logprobs object for `ids`: per token its text, logprob and bytes, and the `k` likeliest."""
        tok = self.engine.tokenizer

        def item(t, lp) -> dict:
            return {"token": self.engine.decode_token(t), "logprob": lp.logprob, "bytes": list(tok.token_bytes(t))}

        return {"content": [{**item(t, entry[t]), "top_logprobs": [
            item(u, lp) for u, lp in sorted(entry.items(), key=lambda e: e[1].rank) if lp.rank <= k]}
            for t, entry in zip(ids, entries)]}

    async def create_chat_completion(self, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_auth(request)
        req = parse_body(ChatRequest, await self.read_body(request))
        self.check_model(req)  # a wrong model is a 404, also for a model without a chat template
        if self.template is None:
            raise BadRequest("this model has no chat template (no chat_template.jinja or tokenizer_config.json "
                             "chat_template in its folder; pass --chat-template FILE): use /v1/completions")
        if not req.messages:
            raise BadRequest("messages must not be empty", "messages")
        try:  # the messages are checked first, the template runs after the other fields' checks
            messages = [chat_message(i, {"role": m.role, "content": m.content, "name": m.name,
                                         "tool_calls": m.tool_calls}) for i, m in enumerate(req.messages)]
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        try:  # vLLM's: the two modes, also as chat_template_kwargs (which win); not both
            modes = chat_modes(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
        except ValueError as e:  # both modes on, or a value of chat_template_kwargs (the request's own are typed)
            both = str(e).startswith("add_generation_prompt and continue_final_message")
            raise BadRequest(str(e), "continue_final_message" if both else "chat_template_kwargs") from None
        k = (req.top_logprobs or 0) if req.logprobs else None
        try:  # the template's own error (raise_exception): the request's problem
            text = self.template.render(messages, *modes)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        text, ids = self.validate_prompt(text, SamplingParams(), "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as the OpenAI API: as long as the context allows (here also the server's limit)
            max_tokens = max(1, min(self.config.max_tokens_limit, self.max_model_len - len(ids)))
        params = self.sampling_params(req, max_tokens, k, None, len(ids), names={
            "logprobs": "top_logprobs",
            "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"})
        self.check_request(ids, params, "messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.config.model_name}
        tok = self.engine.tokenizer
        parse = self.config.reasoning_parser is not None
        keep = req.include_reasoning  # false: the reasoning is split off and left out (vLLM's include_reasoning)
        opened = parse and prompt_opens_reasoning(text)
        sub = self.submit([(text, ids)], params, arrival, req.checkpoint_positions)
        if req.stream:
            streams: dict[int, SampleStream] = {}
            parts: dict[int, ReasoningStream] = {}

            def one(j: int, out: RequestOutput) -> dict | None:
                comp = out.outputs[j]
                if j in streams and streams[j].unchanged(comp, out.finished):
                    return None
                d, lp = {}, None
                if j not in streams:
                    d["role"], streams[j] = "assistant", SampleStream(tok, 0, k is not None)
                    parts[j] = ReasoningStream(opened)
                new, _, shown = streams[j].advance(comp, comp.text, out.finished)
                if parse:
                    d.update((name, new) for name, new in parts[j].advance(streams[j].text, out.finished).items()
                             if keep or name != "reasoning")
                elif new:
                    d["content"] = new
                if shown.stop > shown.start:
                    lp = self.chat_logprobs(comp.token_ids[shown], comp.logprobs[shown], k)
                if not d and lp is None and not out.finished:
                    return None
                return {"index": j, "delta": d, "logprobs": lp,
                        "finish_reason": comp.finish_reason if out.finished else None}

            def delta(i: int, out: RequestOutput) -> list[dict]:
                return [c for j in range(len(out.outputs)) if (c := one(j, out)) is not None]

            return self.stream_response(request, sub, {**head, "object": "chat.completion.chunk"}, delta,
                                        req.stream_options)
        final = None
        async for _, out in self.outputs(request, sub):
            final = out if out.finished else final
        if final is None:
            return Response(status_code=499)
        choices = []
        for j, comp in enumerate(final.outputs):
            lp = None
            if k is not None:
                n = shown_tokens(text_offsets(tok, comp.token_ids), len(comp.text), comp.finish_reason != "stop")
                lp = self.chat_logprobs(comp.token_ids[:n], comp.logprobs[:n], k)
            message = {"role": "assistant", "content": comp.text}
            if parse:
                reasoning, message["content"] = split_reasoning(comp.text, opened, True)
                message["reasoning"] = reasoning if keep else None
            choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": comp.finish_reason})
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": self.usage([final])})
