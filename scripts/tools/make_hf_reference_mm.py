#!/usr/bin/env python
"""Produce the second transformers reference fixture (tests/fixtures/hf_tiny_mm): a tied multimodal checkpoint.

Run by hand with the reference environment (torch 2.13.0 CPU, transformers 5.24), never by the tests:

    .venv-ref/bin/python scripts/tools/make_hf_reference_mm.py --out tests/fixtures/hf_tiny_mm --seed 0

It covers what tests/fixtures/hf_tiny (scripts/tools/make_hf_reference.py) does not, in one small checkpoint:

* the released layout, written by transformers itself: ``Qwen3_5ForConditionalGeneration.save_pretrained`` of a
  ``qwen3_5`` config (``model.language_model.*`` keys next to a tiny vision tower's ``model.visual.*``), with
  ``mrope_section`` / ``mrope_interleaved`` in ``rope_parameters``;
* tied embeddings as transformers writes them: ``tie_word_embeddings`` true at the top level and false in
  ``text_config``, no ``lm_head.weight`` stored (the logits come from the embedding table);
* shapes unlike the first fixture: layers G A G A (a repeating group of single layers), 2 query heads and ONE kv
  head of head_dim 24 (not hidden / heads = 32), partial_rotary_factor 0.5 (12 rotary dims, theta 1e6), GDN with as
  many value heads as key heads (2 x 16, no head repeat), conv kernel 3, vocab 256, MLP 32.

``reference.npz`` (float32 logits of the eager attention path, as in the first fixture): ``prompt_ids`` [100]
(one chunk of 64 and a ragged 36), ``logits_full`` [100, 256] (one forward, no cache), ``logits_decode`` [100, 256]
(token 0 as a 1-token prefill, then one token per call with the cache), ``prefix_len`` = 40 and
``logits_continue`` [60, 256] (the prefix prefilled with a cache, then the rest in one call), ``greedy_prompt_len``
= 20 and ``greedy_ids`` [16] (``generate`` with do_sample=False and no eos), and provenance.
Weights are perturbed as in the first fixture (``common.perturb``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import import_reference, perturb, reference_args  # noqa: E402

torch, transformers = import_reference("make_hf_reference_mm.py")
from transformers import GenerationConfig  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402

PROMPT_LEN, PREFIX_LEN, GREEDY_PROMPT_LEN, GREEDY_NEW = 100, 40, 20, 16
VOCAB = 256
L, A = "linear_attention", "full_attention"


def make_config() -> Qwen3_5Config:
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, layer_types=[L, A, L, A],
        num_attention_heads=2, num_key_value_heads=1, head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 2, 2], "mrope_interleaved": True},
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=3, rms_norm_eps=1e-6, max_position_embeddings=4096, initializer_range=0.08,
        hidden_act="silu", attention_bias=False, bos_token_id=None, pad_token_id=None, eos_token_id=1,
    )
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=2,
                  num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def main() -> None:
    args = reference_args("make_hf_reference_mm.py", __doc__, "tests/fixtures/hf_tiny_mm")

    model = Qwen3_5ForConditionalGeneration(make_config()).to(torch.float32).eval()
    perturb(model, torch.Generator().manual_seed(args.seed + 1))
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied

    prompt = np.random.default_rng(args.seed).integers(2, VOCAB, size=PROMPT_LEN).astype(np.int32)
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    logits_full = model(ids, use_cache=False).logits[0].float().numpy()
    assert logits_full.std() > 0.3, logits_full.std()

    out = model(ids[:, :1], use_cache=True)
    cache, rows = out.cache, [out.logits[0, -1]]
    for t in range(1, PROMPT_LEN):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0, -1])
    logits_decode = torch.stack(rows).float().numpy()

    out = model(ids[:, :PREFIX_LEN], use_cache=True)
    logits_continue = model(ids[:, PREFIX_LEN:], cache=out.cache, use_cache=True).logits[0].float().numpy()
    for name, arr, want in (("decode", logits_decode, logits_full),
                            ("continue", logits_continue, logits_full[PREFIX_LEN:])):
        d = float(np.abs(arr - want).max())
        print(f"max|logits_{name} - logits_full| = {d:.3e}")
        assert d < 1e-3, (name, d)

    gcfg = GenerationConfig(do_sample=False, max_new_tokens=GREEDY_NEW, min_new_tokens=0, eos_token_id=None,
                            pad_token_id=0, bos_token_id=None)
    greedy = model.generate(ids[:, :GREEDY_PROMPT_LEN], generation_config=gcfg)[0, GREEDY_PROMPT_LEN:]
    greedy = greedy.numpy().astype(np.int32)
    print(f"greedy: {greedy.tolist()}")

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    gen = os.path.join(args.out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    np.savez_compressed(
        os.path.join(args.out, "reference.npz"), prompt_ids=prompt, logits_full=logits_full,
        logits_decode=logits_decode, prefix_len=np.int32(PREFIX_LEN), logits_continue=logits_continue,
        greedy_prompt_len=np.int32(GREEDY_PROMPT_LEN), greedy_ids=greedy, seed=np.int32(args.seed),
        torch_version=np.array(torch.__version__), transformers_version=np.array(transformers.__version__))

    with open(os.path.join(args.out, "config.json")) as fh:
        saved = json.load(fh)
    assert saved["tie_word_embeddings"] is True and saved["text_config"]["tie_word_embeddings"] is False, saved
    from safetensors import safe_open
    with safe_open(os.path.join(args.out, "model.safetensors"), framework="np") as f:
        keys = sorted(f.keys())
    assert "lm_head.weight" not in keys and any(k.startswith("model.visual.") for k in keys)
    re = Qwen3_5ForConditionalGeneration.from_pretrained(args.out, attn_implementation="eager",
                                                         dtype=torch.float32).eval()
    d_rt = float(np.abs(re(ids, use_cache=False).logits[0].numpy() - logits_full).max())
    print(f"from_pretrained round trip max diff = {d_rt:.3e}")
    assert d_rt < 1e-6, d_rt
    for fn in sorted(os.listdir(args.out)):
        print(f"  {fn:20s} {os.path.getsize(os.path.join(args.out, fn)) / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
