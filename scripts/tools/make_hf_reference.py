#!/usr/bin/env python
"""Produce the HuggingFace-transformers reference fixture for the JAX port (tests/fixtures/hf_tiny).

This is the ONLY torch user in the project. It is run by hand, never by the tests:

    /tmp/refvenv/bin/python scripts/tools/make_hf_reference.py --out tests/fixtures/hf_tiny --seed 0

(the venv has torch==2.13.0 CPU and transformers 5.24; the test suite only reads the files written here).

What it writes into --out:

* ``config.json`` + ``model.safetensors``: a random tiny ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``),
  float32, saved with ``save_pretrained(out, safe_serialization=True)``. Keys use the text layout
  (``model.embed_tokens.weight``, ``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight``).
  4 layers: linear, linear, linear, full attention; hidden 64, vocab 512, 4 q heads / 2 kv heads of dim 32,
  partial RoPE 0.25 (8 rotary dims, theta 1e4), GDN with 2 key heads / 4 value heads of dim 16, conv kernel 4.
* ``reference.npz`` (float32 logits computed with the eager attention path):

  - ``prompt_ids`` [150] int32: ``np.random.default_rng(seed).integers(2, 512, 150)``
    (150 tokens = 2 full chunks of 64 + a ragged 22-token chunk).
  - ``logits_full`` [150, 512]: one forward over the whole prompt, no cache (chunked GDN path).
  - ``logits_full_f64`` [150, 512] float64: the same prompt through ``independent_forward_f64`` below, an
    independent float64 re-implementation from DESIGN.md §3 (recurrent delta rule, conv state as [K-1, C]).
    transformers keeps norms, softmax, gates and the delta rule in float32 even for a float64 model, so this
    is the near-exact target; HF's own float32 paths sit ~1e-4 away from it (see the printed summary).
  - ``logits_decode`` [150, 512]: token 0 as a 1-token prefill with a fresh cache, then one token per call
    with the cache (exercises transformers' recurrent GDN path + ``causal_conv1d_update``).
  - ``prefix_len`` = 70, ``logits_continue`` [80, 512]: prefill ``prompt_ids[:70]`` with a cache, then forward
    ``prompt_ids[70:]`` in ONE call on top of that cache (chunked GDN path with an initial state and
    a carried conv state). Row j is the logits at absolute position 70 + j.
  - ``conv_state_{i}`` / ``recurrent_state_{i}`` for every GDN layer index i (0, 1, 2): the cache contents
    right after prefilling the 70-token prefix, copied verbatim from transformers' cache
    (``cache.layers[i].conv_states[0]`` / ``cache.layers[i].recurrent_states[0]``), batch dim kept.
  - ``greedy_prompt_len`` = 40, ``greedy_ids`` [24] int32: new tokens only of
    ``model.generate(prompt_ids[:40][None], max_new_tokens=24, do_sample=False)`` run with a
    GenerationConfig whose ``eos_token_id`` is None (no early stop, no eos suppression); the script also
    re-derives the same tokens with a manual argmax loop and asserts they agree.
  - ``torch_version``, ``transformers_version``, ``seed``: provenance strings / ints.

Cache layout in transformers 5.24 (``cache_utils.LinearAttentionLayer``):

* conv state: shape ``[B, conv_dim, K]`` = ``[1, 128, 4]`` here, ``conv_dim = 2*nk*dk + nv*dv`` in the
  channel order of ``in_proj_qkv`` rows ``[Q | K | V]``. It holds the last **K** (not K-1) *pre-conv* inputs
  (the raw ``in_proj_qkv`` outputs, before conv and SiLU), time along the LAST axis, oldest first
  (``[..., -1]`` is the newest token). For a prefill shorter than K it is left-padded with zeros.
  Only the last K-1 columns are ever used (decode concatenates state + new token = K+1 columns and keeps
  the last output; the oldest column only contributes to a discarded output).
  Map to the JAX layout ``[K-1, C]`` (last K-1 pre-conv inputs, oldest first)::

      jax_conv = conv_state_i[0, :, 1:].T          # [K-1, conv_dim]

* recurrent (SSM) state: shape ``[B, nv, dk, dv]`` = ``[1, 4, 16, 16]``, float32, one matrix per VALUE head,
  ``S[key_dim, value_dim]`` with ``o_t = S^T q_t``. Map to the JAX layout ``[H, dk, dv]``::

      jax_ssm = recurrent_state_i[0]               # [nv, dk, dv], no transpose

  Value head h reads key/query head ``h // (nv // nk)`` (``repeat_interleave`` in transformers).

Parameters are perturbed away from transformers' init so that mistakes show (see ``common.perturb``):
zero-centred RMSNorm weights (input/post-attention/final norm, q_norm, k_norm; applied as ``1 + w``)
~ N(0, 0.3); the GDN gated norm weight (applied as plain ``w``) ~ 1 + N(0, 0.3); ``dt_bias`` ~ N(0, 0.5);
``conv1d.weight`` ~ N(0, 0.5) so the short conv matters; linear/embedding weights ~ N(0, initializer_range=0.08).
``A_log`` keeps transformers' default init ``log(uniform(0.01, 16))`` (the "default decay init" case).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import import_reference, perturb, reference_args  # noqa: E402

torch, transformers = import_reference("make_hf_reference.py")
from transformers import GenerationConfig  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

PROMPT_LEN = 150
PREFIX_LEN = 70
GREEDY_PROMPT_LEN = 40
GREEDY_NEW = 24
VOCAB = 512
EOS_ID = 1


def make_config() -> Qwen3_5TextConfig:
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        initializer_range=0.08,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
    )
    cfg._attn_implementation = "eager"
    return cfg


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def independent_forward_f64(sd: dict, cfg: Qwen3_5TextConfig, ids: np.ndarray) -> np.ndarray:
    """Independent float64 re-implementation of Qwen3_5ForCausalLM written from DESIGN.md §3 (not from
    transformers' code paths, which keep RMSNorm / softmax / gates / the delta rule in float32 even for a
    float64 model). Plain recurrent gated delta rule, conv state kept as [K-1, C] like the JAX port,
    NeoX rotate_half RoPE on the first head_dim * partial_rotary_factor dims. Returns [T, vocab] logits."""
    d = lambda k: sd[k].double()  # noqa: E731
    eps = cfg.rms_norm_eps
    T = len(ids)
    h = d("model.embed_tokens.weight")[torch.from_numpy(ids.astype(np.int64))]  # [T, D]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot = int(hd * cfg.rope_parameters["partial_rotary_factor"])
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None]  # [T, rot/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [T, rot]

    def rope(x):  # x [T, H, hd]
        xr, xp = x[..., :rot], x[..., rot:]
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        rh = torch.cat([-x2, x1], -1)
        return torch.cat([xr * cos[:, None] + rh * sin[:, None], xp], -1)

    for i, lt in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        x = rms(h, eps) * (1 + d(p + "input_layernorm.weight"))
        if lt == "linear_attention":
            a = p + "linear_attn."
            qkv = x @ d(a + "in_proj_qkv.weight").T  # [T, C] rows [Q | K | V]
            z = (x @ d(a + "in_proj_z.weight").T).reshape(T, nv, dv)
            beta = torch.sigmoid(x @ d(a + "in_proj_b.weight").T)  # [T, nv]
            g = -d(a + "A_log").exp() * torch.nn.functional.softplus(x @ d(a + "in_proj_a.weight").T + d(a + "dt_bias"))
            w = d(a + "conv1d.weight")[:, 0, :]  # [C, K]; out[t] = sum_j w[:, j] * in[t - (K-1) + j]
            conv_state = torch.zeros(K - 1, qkv.shape[1], dtype=torch.float64)  # [K-1, C], oldest first
            S = torch.zeros(nv, dk, dv, dtype=torch.float64)
            o = torch.zeros(T, nv, dv, dtype=torch.float64)
            for t in range(T):
                win = torch.cat([conv_state, qkv[t:t + 1]], 0)  # [K, C]
                conv_state = win[1:]
                c = torch.nn.functional.silu((win.T * w).sum(-1))
                q, k, v = c[: nk * dk].reshape(nk, dk), c[nk * dk: 2 * nk * dk].reshape(nk, dk), c[2 * nk * dk:].reshape(nv, dv)
                q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
                k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
                q, k = q.repeat_interleave(nv // nk, 0), k.repeat_interleave(nv // nk, 0)  # value head h -> key head h // (nv/nk)
                S = S * g[t].exp()[:, None, None]
                u = beta[t][:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
                S = S + k[:, :, None] * u[:, None, :]
                o[t] = torch.einsum("hkv,hk->hv", S, q)
            o = rms(o, eps) * d(a + "norm.weight") * torch.nn.functional.silu(z)
            h = h + o.reshape(T, nv * dv) @ d(a + "out_proj.weight").T
        else:
            a = p + "self_attn."
            qg = (x @ d(a + "q_proj.weight").T).reshape(T, nh, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
            k = (x @ d(a + "k_proj.weight").T).reshape(T, nkv, hd)
            v = (x @ d(a + "v_proj.weight").T).reshape(T, nkv, hd)
            q = rope(rms(q, eps) * (1 + d(a + "q_norm.weight")))
            k = rope(rms(k, eps) * (1 + d(a + "k_norm.weight")))
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            att = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nh * hd)
            h = h + (att * torch.sigmoid(gate)) @ d(a + "o_proj.weight").T
        x = rms(h, eps) * (1 + d(p + "post_attention_layernorm.weight"))
        m = p + "mlp."
        h = h + (torch.nn.functional.silu(x @ d(m + "gate_proj.weight").T) * (x @ d(m + "up_proj.weight").T)) \
            @ d(m + "down_proj.weight").T
    h = rms(h, eps) * (1 + d("model.norm.weight"))
    head = d("model.embed_tokens.weight") if cfg.tie_word_embeddings else d("lm_head.weight")
    return (h @ head.T).numpy()


@torch.no_grad()
def main() -> None:
    args = reference_args("make_hf_reference.py", __doc__, "tests/fixtures/hf_tiny")

    cfg = make_config()
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    gen = torch.Generator().manual_seed(args.seed + 1)
    perturb(model, gen)

    lt = cfg.layer_types
    gdn_layers = [i for i, t in enumerate(lt) if t == "linear_attention"]

    prompt = np.random.default_rng(args.seed).integers(2, VOCAB, size=PROMPT_LEN).astype(np.int32)
    ids = torch.from_numpy(prompt.astype(np.int64))[None]

    # 1. full forward, no cache
    logits_full = model(ids, use_cache=False).logits[0].float().numpy()
    std = float(logits_full.std())
    tok_std = float(logits_full.std(axis=0).mean())  # spread across positions for a fixed vocab entry
    print(f"logits_full std={std:.3f}  mean per-vocab std over positions={tok_std:.3f}")
    assert std > 0.5, f"logits too flat (std {std})"
    assert tok_std > 0.3, f"logits barely depend on the token (per-vocab std {tok_std})"

    # 2. token-by-token decode with the cache
    out = model(ids[:, :1], use_cache=True)
    cache = out.cache
    rows = [out.logits[0, -1]]
    for t in range(1, PROMPT_LEN):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0, -1])
    logits_decode = torch.stack(rows).float().numpy()
    d_dec = float(np.abs(logits_decode - logits_full).max())
    print(f"max|logits_decode - logits_full| = {d_dec:.3e}")
    assert d_dec < 1e-3, d_dec

    # 3. prefix prefill + continuation in one call; grab states after the prefix
    out = model(ids[:, :PREFIX_LEN], use_cache=True)
    cache = out.cache
    d_pre = float(np.abs(out.logits[0].numpy() - logits_full[:PREFIX_LEN]).max())
    print(f"max|prefill(70) - logits_full[:70]| = {d_pre:.3e}")
    states = {}
    for i in gdn_layers:
        layer = cache.layers[i]
        cs = layer.conv_states[0]
        rs = layer.recurrent_states[0]
        assert cs is cache.get_conv_state(i) and rs is cache.get_recurrent_state(i)
        # the cache updates in place (copy_) on the next forward: clone now
        states[f"conv_state_{i}"] = cs.detach().clone().float().numpy()
        states[f"recurrent_state_{i}"] = rs.detach().clone().float().numpy()
    out = model(ids[:, PREFIX_LEN:], cache=cache, use_cache=True)
    logits_continue = out.logits[0].float().numpy()
    d_cont = float(np.abs(logits_continue - logits_full[PREFIX_LEN:]).max())
    print(f"max|logits_continue - logits_full[70:]| = {d_cont:.3e}")
    assert d_cont < 1e-3, d_cont

    # sanity: the conv state is the last K pre-conv inputs (in_proj_qkv outputs of layer-input-normed hidden)
    K = cfg.linear_conv_kernel_dim
    hs = model(ids[:, :PREFIX_LEN], use_cache=False, output_hidden_states=True).hidden_states
    for i in gdn_layers:
        layer = model.model.layers[i]
        x = layer.input_layernorm(hs[i])
        qkv = layer.linear_attn.in_proj_qkv(x)  # [1, T, C]
        want = qkv[0, -K:].T.numpy()  # [C, K], oldest first
        got = states[f"conv_state_{i}"][0]
        dc = float(np.abs(want - got).max())
        assert dc < 1e-5, (i, dc)
    print(f"conv_state layout check OK: conv_state[0, :, j] == in_proj_qkv(x)[T-K+j] (K={K})")

    # 3b. independent float64 forward (near-exact reference; also cross-checks the layout facts)
    logits_full_f64 = independent_forward_f64(dict(model.state_dict()), cfg, prompt)
    for name, arr in (("logits_full", logits_full), ("logits_decode", logits_decode)):
        print(f"max|{name} - logits_full_f64| = {float(np.abs(arr - logits_full_f64).max()):.3e}")
    d64 = float(np.abs(logits_full - logits_full_f64).max())
    assert d64 < 1e-3, d64

    # 4. greedy generate, no early stop on eos
    gp = ids[:, :GREEDY_PROMPT_LEN]
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=GREEDY_NEW, min_new_tokens=0,
                            eos_token_id=None, pad_token_id=0, bos_token_id=None)
    gout = model.generate(gp, generation_config=gcfg)
    greedy = gout[0, GREEDY_PROMPT_LEN:].numpy().astype(np.int32)
    assert greedy.shape == (GREEDY_NEW,), greedy.shape
    # manual greedy with the cache
    out = model(gp, use_cache=True)
    cache, manual = out.cache, []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(GREEDY_NEW):
        manual.append(nxt)
        out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        nxt = int(out.logits[0, -1].argmax())
    assert manual == greedy.tolist(), (manual, greedy.tolist())
    print(f"greedy ({GREEDY_NEW} new tokens after {GREEDY_PROMPT_LEN}): {greedy.tolist()}"
          f"  contains eos {EOS_ID}: {EOS_ID in greedy.tolist()}")

    # 5. save
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(args.out, extra)
        if os.path.exists(p):
            os.remove(p)  # not needed by the JAX loader; keep the fixture minimal
    st = os.path.join(args.out, "model.safetensors")
    os.chmod(st, 0o644)
    size = os.path.getsize(st)
    assert size < 2 * 1024 * 1024, size

    np.savez_compressed(
        os.path.join(args.out, "reference.npz"),
        prompt_ids=prompt,
        logits_full=logits_full.astype(np.float32),
        logits_decode=logits_decode.astype(np.float32),
        logits_full_f64=logits_full_f64.astype(np.float64),
        prefix_len=np.int32(PREFIX_LEN),
        logits_continue=logits_continue.astype(np.float32),
        greedy_prompt_len=np.int32(GREEDY_PROMPT_LEN),
        greedy_ids=greedy,
        seed=np.int32(args.seed),
        torch_version=np.array(torch.__version__),
        transformers_version=np.array(transformers.__version__),
        **{k: v.astype(np.float32) for k, v in states.items()},
    )

    # 6. verify the saved checkpoint round-trips through from_pretrained
    re = Qwen3_5ForCausalLM.from_pretrained(args.out, attn_implementation="eager", dtype=torch.float32).eval()
    d_rt = float(np.abs(re(ids, use_cache=False).logits[0].numpy() - logits_full).max())
    print(f"from_pretrained round trip max diff = {d_rt:.3e}")
    assert d_rt == 0.0 or d_rt < 1e-6, d_rt

    from safetensors import safe_open
    with safe_open(st, framework="np") as f:
        keys = sorted(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    print(f"\n{len(keys)} tensors in model.safetensors ({size / 1024:.1f} KiB):")
    for k in keys:
        print(f"  {k:55s} {shapes[k]}")
    with open(os.path.join(args.out, "config.json")) as fh:
        print("\nconfig.json:", json.dumps(json.load(fh), indent=1, sort_keys=True))
    print("\nfiles:")
    for fn in sorted(os.listdir(args.out)):
        print(f"  {fn:20s} {os.path.getsize(os.path.join(args.out, fn)) / 1024:.1f} KiB")
    print("\nstate shapes:", {k: v.shape for k, v in states.items()})


if __name__ == "__main__":
    main()
