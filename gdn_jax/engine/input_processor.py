"""A request's way in: its prompt tokenized and checked, its sampling parameters completed by the model's defaults
(end-of-sequence ids, generation_config.json's sampling fields)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from gdn_jax.config import folder_json
from scheduler import SamplingParams
from scheduler.sampling_params import MAX_STOP_TOKEN_IDS

MAX_FULL_ROW_VOCAB = 65_536  # prompt_logprobs=-1 returns whole rows only for vocabularies up to this size
MAX_CHECKPOINT_POSITIONS = 16  # hinted checkpoints per prompt


def _token_list(ids, what: str = "a token-id prompt") -> list:
    """Token ids as Python ints (numpy integers included); anything else is kept as is for the error message. `ids`
    must be a list, a tuple or a 1-D array (`what` names it in the error)."""
    if not isinstance(ids, (list, tuple, np.ndarray)) or isinstance(ids, np.ndarray) and ids.ndim != 1:
        shape = f"a {np.ndim(ids)}-D array" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise ValueError(f"{what} must be a list of token ids, got {shape}")
    out = []
    for t in np.asarray(ids).tolist() if isinstance(ids, np.ndarray) else ids:
        is_int = isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
        out.append(int(t) if is_int else t)
    return out


def model_eos_ids(folder: Path | None, vocab_size: int | None = None) -> list[int]:
    """The end-of-sequence ids a model folder lists: config.json's `eos_token_id` (an id or a list) and
    generation_config.json's (the same; [] without the files or the fields). A chat model's config.json may name one
    EOS while generation_config.json lists the end-of-turn token too (Qwen3.5: <|endoftext|> there, <|im_end|> and
    <|endoftext|> here); some models list several in config.json itself (the model's `eos_token_id` is the first).
    With `vocab_size`, an id outside the vocabulary is a ValueError naming its file (nothing could end on it)."""
    ids = []
    for name in ("config.json", "generation_config.json"):
        data = folder_json(folder, name)
        text = data.get("text_config")  # a multimodal config.json (qwen3_5) holds the text model's in text_config
        for eos in ((text.get("eos_token_id"),) if isinstance(text, dict) else ()) + (data.get("eos_token_id"),):
            listed = [] if eos is None else eos if isinstance(eos, list) else [eos]
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in listed):
                raise ValueError(f"{Path(folder) / name}: eos_token_id must be a token id or a list of them, "
                                 f"got {eos!r}")
            if vocab_size is not None and any(t >= vocab_size for t in listed):
                raise ValueError(f"{Path(folder) / name}: eos_token_id {eos!r} is outside the vocabulary "
                                 f"[0, {vocab_size})")
            ids += listed
    return list(dict.fromkeys(ids))


# generation_config.json's sampling fields a model's defaults take (vLLM's list; max_new_tokens is max_tokens), each
# with transformers' GenerationConfig default: a field set to that default is no default of the model's (vLLM reads
# the file's difference from GenerationConfig(), so top_k 50 there leaves top-k off)
GENERATION_CONFIG_SAMPLING = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
                              "max_new_tokens": None}


def model_sampling_defaults(folder: Path | None) -> dict:
    """The sampling defaults a model folder's generation_config.json recommends, as SamplingParams keywords
    ({"temperature": 0.6, "top_k": 20, "top_p": 0.95} for Qwen3.5; {} without the file): the fields vLLM takes
    (`GENERATION_CONFIG_SAMPLING`) where they differ from transformers' defaults. A bad value names the file."""
    data = folder_json(folder, "generation_config.json")
    out = {}
    for field, hf_default in GENERATION_CONFIG_SAMPLING.items():
        value = data.get(field)
        if value is None or value == hf_default:
            continue
        name = "max_tokens" if field == "max_new_tokens" else field
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            raise ValueError(f"{Path(folder) / 'generation_config.json'}: {e}") from None
        out[name] = value
    return out


def tokenize(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """A prompt's text (None for token ids) and token ids: a str, a list of ids, or a dict of either."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        other = [k for k in prompt if k not in ("prompt", "prompt_token_ids", "checkpoint_positions")]
        if other:  # e.g. vLLM's multi_modal_data, or a misspelt key: ignoring it would run another request
            raise ValueError(f"a dict prompt takes 'prompt', 'prompt_token_ids' and 'checkpoint_positions' only, "
                             f"got {other[0]!r}")
        text = prompt.get("prompt")
        if ("prompt" in prompt or text is not None) and not isinstance(text, str) and not (
                text is None and "prompt_token_ids" in prompt):  # with token ids the text is optional
            raise ValueError(f"a dict prompt's 'prompt' must be a str, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, _token_list(prompt["prompt_token_ids"], "'prompt_token_ids'")
        if "prompt" in prompt:
            return text, tokenizer.encode(text)
        raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, _token_list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}: use str, list[int] or a dict")


def checkpoint_positions(positions, num_tokens: int, block_size: int) -> tuple[int, ...]:
    """An application's hint: the prompt positions (token counts) whose states it wants kept as checkpoints, e.g.
    the end of a shared system prompt. A checkpoint holds whole KV blocks, so each is kept at the block boundary at
    or below its position. Returns those boundaries, ascending and distinct; raises ValueError naming the field."""
    if positions is None:
        return ()
    if not isinstance(positions, (list, tuple)):
        raise ValueError(f"checkpoint_positions must be a list of token positions, got {type(positions).__name__}")
    if len(positions) > MAX_CHECKPOINT_POSITIONS:
        raise ValueError(f"checkpoint_positions holds {len(positions)} positions; at most "
                         f"{MAX_CHECKPOINT_POSITIONS} are supported")
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise ValueError(f"checkpoint_positions: {p!r} is not a token position (an int)")
        if not block_size <= p <= num_tokens:
            raise ValueError(f"checkpoint_positions: {p} is outside [{block_size}, {num_tokens}]: a checkpoint holds "
                             f"whole KV blocks of {block_size} tokens of the prompt ({num_tokens} tokens)")
    return tuple(sorted({int(p) // block_size * block_size for p in positions}))


def prompt_hints(prompt) -> dict:
    """The hint keys of a dict prompt (`checkpoint_positions`), to pass on with its token ids; {} for any other."""
    return {"checkpoint_positions": prompt["checkpoint_positions"]} if isinstance(prompt, dict) and prompt.get(
        "checkpoint_positions") is not None else {}


def validate_request(prompt, params: SamplingParams, *, tokenizer, vocab_size: int, extra_eos_ids: list[int],
                     max_model_len: int, block_size: int) -> tuple[str | None, list[int], SamplingParams]:
    """Checks a request against the model (its vocabulary, its further end-of-sequence ids, which join the stop ids
    unless ignore_eos), `max_model_len` and a dict prompt's hints; returns (text, token ids, params) or raises
    ValueError."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.__post_init__()  # re-validate: the object may have been mutated after construction
    bad = [t for t in params.stop_token_ids or () if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: id {bad[0]} outside the vocabulary [0, {vocab_size})")
    extra = [t for t in extra_eos_ids if t not in (params.stop_token_ids or ())]
    if extra:  # they end the request unless ignore_eos; min_tokens bans them in any case, with the stop ids
        stops = [*(params.stop_token_ids or ()), *extra]
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(stops) - len(extra)} ids; with the model's {len(extra)} "
                             f"further end-of-sequence ids (config.json, generation_config.json) at most "
                             f"{MAX_STOP_TOKEN_IDS - len(extra)} are supported")
        if not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=stops)
    text, ids = tokenize(tokenizer, prompt)
    if not ids:
        raise ValueError("empty prompt: at least one token is needed")
    bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]
    if bad and type(bad[0]) is not int:
        raise ValueError(f"token ids must be ints, got {bad[0]!r} ({type(bad[0]).__name__})")
    if bad:
        raise ValueError(f"token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len {max_model_len}")
    checkpoint_positions(prompt_hints(prompt).get("checkpoint_positions"), len(ids), block_size)
    if params.prompt_logprobs == -1 and vocab_size > MAX_FULL_ROW_VOCAB:
        raise ValueError(f"prompt_logprobs=-1 (whole rows) needs a vocabulary of at most {MAX_FULL_ROW_VOCAB} "
                         f"entries; this model has {vocab_size}")
    return text, ids, params
