"""`LLM`: the batch API over the engine (vLLM's `LLM`): `generate` and `chat` over lists of prompts."""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterable

import numpy as np

from gdn_jax.chat import ChatTemplate
from gdn_jax.config import EngineConfig, ModelConfig
from gdn_jax.diagnostics import user_stacklevel
from gdn_jax.engine.input_processor import prompt_hints
from gdn_jax.engine.llm_engine import LLMEngine
from gdn_jax.engine.outputs import EngineStepError, RequestOutput
from scheduler import SamplingParams


class LLM:
    """Batch API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | os.PathLike | ModelConfig | EngineConfig = "tiny", **kwargs):
        """`model` and the keywords are EngineConfig's settings (`LLM(model="tiny", chunk_stride=64)`), or `model`
        is a whole EngineConfig."""
        self.engine = LLMEngine(model, **kwargs)
        self._ids = itertools.count()
        self._chat_templates: dict[str | None, ChatTemplate | None] = {}

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` uses when given no SamplingParams (the model folder's generation_config.json
        sampling fields unless `generation_config="vllm"`)."""
        return self.engine.default_sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """The outputs of `prompts` (a str, a list of token ids, a {"prompt_token_ids": ...} dict, or a list of
        these), in their order. If it is interrupted (KeyboardInterrupt, an error), the batch's unfinished requests
        are aborted, so that nothing of it runs on in a later call."""
        if prompts is None or isinstance(prompts, (bytes, int, float)):
            raise ValueError(f"prompts must be a str, a list of token ids, a dict, or a list of these; got "
                             f"{type(prompts).__name__}")
        if isinstance(prompts, (str, dict, np.ndarray)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # validate all first: nothing is added if one is bad; each is then added as the token ids (and text) its
        # validation found, so that a text prompt is tokenized once
        checked = [self.engine.validate_request(prompt, sp)[:2] for prompt, sp in zip(prompts, params)]
        ids = []
        try:
            for prompt, (text, token_ids), sp in zip(prompts, checked, params):
                rid = str(next(self._ids))
                while rid in self.engine._requests:  # an id the caller gave a request of its own on this engine
                    rid = str(next(self._ids))
                ids.append(rid)  # before it is added: an interrupt right after the add still aborts it
                self.engine.add_request(rid, {"prompt": text, "prompt_token_ids": token_ids, **prompt_hints(prompt)},
                                        sp)
                self.engine._requests[rid].final_only = True
        except BaseException:  # interrupted while adding (a long batch): none of it stays to run in a later call
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's: the replies to a conversation (a list of {"role", "content"} dicts) or to each of a list of
        conversations, in their order. Each is rendered with the model folder's chat template, as transformers'
        `apply_chat_template` renders it (`gdn_jax.chat.ChatTemplate.render`: `add_generation_prompt`,
        `continue_final_message`, `chat_template_kwargs` such as Qwen3.5's {"enable_thinking": False}; as in vLLM an
        add_generation_prompt or continue_final_message there wins over the keyword), or with `chat_template` (a
        template's text) instead, then generated as `generate` generates a text prompt (the output's `prompt` is the
        rendered text). A model without a template, or a bad message, is a ValueError before anything runs."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            conversations = list(messages)
        else:
            conversations = [messages]
        template = self._chat_template(chat_template)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(template.render(conversation, add_generation_prompt, continue_final_message,
                                               chat_template_kwargs))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_template(self, source: str | None) -> ChatTemplate:
        """The compiled template of `source`, else of the model folder (compiled once each)."""
        if source is not None and not isinstance(source, str):
            raise ValueError(f"chat_template must be the template's text (a str) or None, got {source!r}")
        if source not in self._chat_templates:
            self._chat_templates[source] = ChatTemplate.from_folder(self.engine.model_folder, source)
        template = self._chat_templates[source]
        if template is None:
            raise ValueError("this model has no chat template (no chat_template.jinja or tokenizer_config.json "
                             "chat_template in its folder): pass chat_template=, or call generate with the prompt")
        return template

    def _run(self, ids: Iterable[str], use_tqdm: bool) -> list[RequestOutput]:
        ids = list(ids)
        batch = set(ids)
        done: dict[str, RequestOutput] = {}
        bar, complete = None, False
        try:
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(ids), desc="generate", unit="req")
            while self.engine.has_unfinished_requests():
                try:
                    outs = self.engine.step()
                except EngineStepError as err:  # those requests end with finish_reason "error"; the rest go on
                    warnings.warn(str(err), RuntimeWarning, stacklevel=user_stacklevel())
                    outs = err.outputs
                for out in outs:  # requests the caller added to the engine itself run too, uncounted
                    if out.finished and out.request_id in batch:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            complete = True
        finally:
            if not complete:  # interrupted: the batch's requests leave the engine, their slots and blocks freed
                self.engine.abort_request([i for i in ids if i not in done])  # (first: a second Ctrl-C may come)
            if bar is not None:
                bar.close()
        return [done[i] for i in ids if i in done]

    def warm_up(self, prompt_logprobs: bool = False) -> int:
        """Compiles every step shape now, so that later requests (and their TTFTs) pay no compilation; returns the
        number of step shapes (`LLMEngine.warm_up`)."""
        return self.engine.warm_up(prompt_logprobs)

    def cache_stats(self) -> dict:
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()
