#!/usr/bin/env python
"""Produce the sparse-MoE transformers reference fixtures (tests/fixtures/hf_tiny_moe, tests/fixtures/hf_tiny_next).

Run by hand with the reference environment (torch 2.13.0 CPU, transformers 5.24), never by the tests:

    .venv-ref/bin/python scripts/tools/make_hf_reference_moe.py --out tests/fixtures --seed 0

It writes two folders under --out, each a random tiny float32 checkpoint and what transformers computes with it:

* ``hf_tiny_moe/``: a ``Qwen3_5MoeForCausalLM`` (model_type ``qwen3_5_moe_text``). Every layer is a sparse-MoE
  block: 8 experts of intermediate size 32, top-2 (transformers always renormalises the top-k weights of this
  model; its config has no ``norm_topk_prob``), plus a shared expert of intermediate size 48 scaled by
  ``sigmoid(shared_expert_gate(x))``. GDN projections in the Qwen3.5 layout (``in_proj_qkv``, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``).
* ``hf_tiny_next/``: a ``Qwen3NextForCausalLM`` (model_type ``qwen3_next``). Same MoE block (with a shared expert
  and its sigmoid gate), ``norm_topk_prob`` true, ``decoder_sparse_step`` 1 and ``mlp_only_layers`` [1]: layer 1
  has a dense MLP of intermediate size 96 instead. GDN projections in the Qwen3-Next layout (``in_proj_qkvz``,
  ``in_proj_ba``, grouped per key head; each fixture's README gives the row order).

Both: hidden 64, vocab 512, untied embeddings, 4 layers linear, linear, linear, full attention; 4 q heads / 2 kv
heads of dim 32, partial RoPE 0.25 (8 rotary dims, theta 1e4); GDN with 2 key heads / 4 value heads of dim 16, conv
kernel 4; eps 1e-6, eos_token_id 1. ``config.json`` + ``model.safetensors`` come from
``save_pretrained(out, safe_serialization=True)``; transformers 5.24 holds the experts fused in memory
(``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj`` [E, D, I]) but writes them per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``), which this script checks.

``reference.npz`` in each folder (float32 logits of the eager attention path and the eager experts loop):

- ``prompt_ids`` [150] int32: ``np.random.default_rng(seed).integers(2, 512, 150)``.
- ``logits_full`` [150, 512]: one forward over the whole prompt, no cache.
- ``logits_full_f64`` [150, 512]: the same prompt through ``independent_forward_f64`` below (read from the saved
  tensors as the READMEs describe them), computed in float64 and stored rounded to float32 to keep the file small.
  transformers keeps norms, softmax, gates and the delta rule in float32, and the random GDN layers are
  ill-conditioned at a few positions (a core output of tiny rms, blown up by the gated RMSNorm), so transformers' own
  float32 paths sit up to ~2e-3 from this near-exact target and from each other (the READMEs give the numbers).
- ``prefix_len`` = 70, ``logits_continue`` [80, 512]: prefill ``prompt_ids[:70]`` with a cache, then forward
  ``prompt_ids[70:]`` in ONE call on top of that cache. Row j is the logits at absolute position 70 + j.
- ``logits_decode`` [150, 512]: token 0 as a 1-token prefill with a fresh cache, then one token per call.
- ``greedy_prompt_len`` = 40, ``greedy_ids`` [24] int32: new tokens of ``model.generate(prompt_ids[:40][None],
  max_new_tokens=24, do_sample=False)`` with a GenerationConfig whose ``eos_token_id`` is None and with
  ``model.generation_config.eos_token_id`` cleared too (``generate`` fills a None from it): no early stop, no eos
  suppression. Checked against a manual argmax loop with the cache.
- ``batch_ids`` [4, 40] int32: four prompts drawn one at a time as ``rng.integers(2, 512, 40)`` from
  ``rng = np.random.default_rng(seed + 1)``, a draw kept only if every router's gap between its k-th and (k+1)-th
  probability is at least ``MIN_GAP`` = 1e-4 over that prompt (so that float32 rounding elsewhere cannot flip an
  expert), and ``batch_logits`` [4, 40, 512]: one batched forward of the four (no padding, no cache); each row is
  checked against the prompt's forward alone.
- ``router_top_experts_layer0`` [150, 2] int32: the expert indices layer 0's router picks in ``logits_full``'s
  pass (``torch.topk`` of the softmax over the 8 router logits, column 0 the most probable), taken by a hook.
- ``torch_version``, ``transformers_version``, ``seed``: provenance.

Weights are perturbed away from transformers' init so that mistakes show: ``common.perturb`` (zero-centred RMSNorm
weights ~ N(0, 0.3), applied as 1 + w; the GDN gated-norm weight ~ 1 + N(0, 0.3); ``dt_bias`` ~ N(0, 0.5);
``conv1d.weight`` ~ N(0, 0.5); torch generator seed + 1), then every router ``mlp.gate.weight`` ~ N(0, 0.3) (router
logits of std ~2, so the tokens spread over the experts and the two top weights differ) and every
``mlp.shared_expert_gate.weight`` ~ N(0, 0.3) (the shared expert's sigmoid gate varies per token), drawn in
sorted-name order from torch generator seed + 2 + d, where d is the first draw (0, 1, ...) whose forward of
``prompt_ids`` has no router gap (k-th minus (k+1)-th probability, any layer, any token) below ``MIN_GAP``. Experts
and the other matrices keep transformers' init, N(0, initializer_range = 0.08); ``A_log`` keeps the default
``log(uniform(0.01, 16))``. The script asserts that no stored pass has a router gap below ``MIN_GAP`` / 2.

The script also runs an independent float64 forward written from the READMEs' description of the saved tensors
(``independent_forward_f64``): it reads ``model.safetensors`` as saved, checks the routing and logits against
transformers', and shows that the usual mistakes (top-k weights not renormalised, the shared-expert gate left out,
gate/up swapped, the Qwen3-Next projections read in the Qwen3.5 order) move the logits far beyond the tolerance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import import_reference, perturb  # noqa: E402

torch, transformers = import_reference("make_hf_reference_moe.py")
from transformers import GenerationConfig  # noqa: E402
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

PROMPT_LEN = 150
PREFIX_LEN = 70
GREEDY_PROMPT_LEN = 40
GREEDY_NEW = 24
BATCH, BATCH_LEN = 4, 40
VOCAB = 512
EOS_ID = 1
MIN_GAP = 1e-4  # smallest router gap (k-th minus (k+1)-th probability) the prompts may have: no near ties
L, A = "linear_attention", "full_attention"

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, layer_types=[L, L, L, A],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
    initializer_range=0.08, hidden_act="silu", attention_bias=False, bos_token_id=None, pad_token_id=None,
    eos_token_id=EOS_ID,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
)


def make_config(kind: str):
    if kind == "moe":
        cfg = Qwen3_5MoeTextConfig(**COMMON)
    else:
        cfg = Qwen3NextConfig(**COMMON, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1],
                              norm_topk_prob=True)
    cfg._attn_implementation = "eager"
    return cfg


def perturb_moe(model, gen) -> None:
    """Redraws the routers and the shared-expert gates from torch generator `gen`."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float32))


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def is_moe_layer(cfg: dict, i: int) -> bool:
    """transformers' rule: Qwen3.5-MoE has a sparse block in every layer; Qwen3-Next in layer i unless
    i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
    if cfg["model_type"] == "qwen3_5_moe_text":
        return True
    return i not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0


def qwen35_gdn_projections(w: dict, cfg: dict, a: str) -> tuple:
    """(W_qkv [2*nk*dk + nv*dv, D] rows [Q | K | V], W_z [nv*dv, D], W_b [nv, D], W_a [nv, D]) of GDN prefix `a`:
    read as saved for Qwen3.5-MoE, de-interleaved from in_proj_qkvz / in_proj_ba for Qwen3-Next."""
    if a + "in_proj_qkv.weight" in w:
        return tuple(w[a + f"in_proj_{part}.weight"] for part in ("qkv", "z", "b", "a"))
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    qkvz = w[a + "in_proj_qkvz.weight"]  # [nk * (2*dk + 2*r*dv), D], per key head g: [q_g | k_g | v_g | z_g]
    D = qkvz.shape[1]
    g = qkvz.reshape(nk, 2 * dk + 2 * r * dv, D)
    q, k = g[:, :dk].reshape(nk * dk, D), g[:, dk:2 * dk].reshape(nk * dk, D)
    v = g[:, 2 * dk:2 * dk + r * dv].reshape(nv * dv, D)  # value head g*r + j = rows j*dv:(j+1)*dv of group g
    z = g[:, 2 * dk + r * dv:].reshape(nv * dv, D)
    ba = w[a + "in_proj_ba.weight"].reshape(nk, 2 * r, D)  # per key head g: [b_g (r rows) | a_g (r rows)]
    return torch.cat([q, k, v]), z, ba[:, :r].reshape(nv, D), ba[:, r:].reshape(nv, D)


@torch.no_grad()
def independent_forward_f64(w: dict, cfg: dict, ids: np.ndarray, mistake: str | None = None) -> tuple:
    """Independent float64 forward of either model, written from the fixtures' READMEs (the saved tensor names and
    layouts, not transformers' modules): plain recurrent gated delta rule, conv state as [K-1, C], NeoX rotate_half
    RoPE on the first head_dim * partial_rotary_factor dims, MoE = softmax over all experts, top-k, renormalised,
    plus sigmoid-gated shared expert. `w` maps the safetensors names to float64 torch tensors. `mistake` plants one
    known error (to show the fixture catches it). Returns ([T, vocab] logits, {layer: [T, k] top expert indices},
    smallest gap between the k-th and (k+1)-th router probability over all MoE layers and tokens)."""
    eps = cfg["rms_norm_eps"]
    T = len(ids)
    h = w["model.embed_tokens.weight"][torch.from_numpy(ids.astype(np.int64))]  # [T, D]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, k_top = cfg["num_experts"], cfg["num_experts_per_tok"]
    norm_topk = cfg.get("norm_topk_prob", True)  # qwen3_5_moe_text has no such field: always renormalised
    rp = cfg["rope_parameters"]
    rot = int(hd * rp["partial_rotary_factor"])
    inv_freq = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None]  # [T, rot/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [T, rot]
    silu = torch.nn.functional.silu

    def rope(x):  # x [T, H, hd]
        xr, xp = x[..., :rot], x[..., rot:]
        rh = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], -1)
        return torch.cat([xr * cos[:, None] + rh * sin[:, None], xp], -1)

    def mlp(x, gate, up, down):  # weights [I, D], [I, D], [D, I]
        if mistake == "gate_up_swapped":
            gate, up = up, gate
        return (silu(x @ gate.T) * (x @ up.T)) @ down.T

    top, min_gap = {}, float("inf")
    for i, lt in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        x = rms(h, eps) * (1 + w[p + "input_layernorm.weight"])
        if lt == "linear_attention":
            a = p + "linear_attn."
            if mistake == "qkvz_read_as_qwen35" and a + "in_proj_qkvz.weight" in w:
                qkvz, ba = w[a + "in_proj_qkvz.weight"], w[a + "in_proj_ba.weight"]
                wqkv, wz, wb, wa = qkvz[:2 * nk * dk + nv * dv], qkvz[2 * nk * dk + nv * dv:], ba[:nv], ba[nv:]
            else:
                wqkv, wz, wb, wa = qwen35_gdn_projections(w, cfg, a)
            qkv = x @ wqkv.T  # [T, C] channels [Q | K | V]
            z = (x @ wz.T).reshape(T, nv, dv)
            beta = torch.sigmoid(x @ wb.T)  # [T, nv]
            g = -w[a + "A_log"].exp() * torch.nn.functional.softplus(x @ wa.T + w[a + "dt_bias"])
            cw = w[a + "conv1d.weight"][:, 0, :]  # [C, K]; out[t] = sum_j cw[:, j] * in[t - (K-1) + j]
            conv_state = torch.zeros(K - 1, qkv.shape[1], dtype=torch.float64)  # [K-1, C], oldest first
            S = torch.zeros(nv, dk, dv, dtype=torch.float64)
            o = torch.zeros(T, nv, dv, dtype=torch.float64)
            for t in range(T):
                win = torch.cat([conv_state, qkv[t:t + 1]], 0)  # [K, C]
                conv_state = win[1:]
                c = silu((win.T * cw).sum(-1))
                q, kk = c[: nk * dk].reshape(nk, dk), c[nk * dk: 2 * nk * dk].reshape(nk, dk)
                v = c[2 * nk * dk:].reshape(nv, dv)
                q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
                kk = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
                q, kk = q.repeat_interleave(nv // nk, 0), kk.repeat_interleave(nv // nk, 0)  # value head h -> h // r
                S = S * g[t].exp()[:, None, None]
                u = beta[t][:, None] * (v - torch.einsum("hkv,hk->hv", S, kk))
                S = S + kk[:, :, None] * u[:, None, :]
                o[t] = torch.einsum("hkv,hk->hv", S, q)
            o = rms(o, eps) * w[a + "norm.weight"] * silu(z)
            h = h + o.reshape(T, nv * dv) @ w[a + "out_proj.weight"].T
        else:
            a = p + "self_attn."
            qg = (x @ w[a + "q_proj.weight"].T).reshape(T, nh, 2 * hd)  # per head [q (hd) | gate (hd)]
            q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
            kk = (x @ w[a + "k_proj.weight"].T).reshape(T, nkv, hd)
            v = (x @ w[a + "v_proj.weight"].T).reshape(T, nkv, hd)
            q = rope(rms(q, eps) * (1 + w[a + "q_norm.weight"]))
            kk = rope(rms(kk, eps) * (1 + w[a + "k_norm.weight"]))
            kk, v = kk.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            s = torch.einsum("qhd,khd->hqk", q, kk) * hd ** -0.5
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            att = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nh * hd)
            h = h + (att * torch.sigmoid(gate)) @ w[a + "o_proj.weight"].T
        x = rms(h, eps) * (1 + w[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        if not is_moe_layer(cfg, i):
            h = h + mlp(x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
            continue
        probs = (x @ w[m + "gate.weight"].T).softmax(-1)  # [T, E], softmax over ALL experts
        srt = probs.sort(-1, descending=True).values
        min_gap = min(min_gap, float((srt[:, k_top - 1] - srt[:, k_top]).min()))
        wt, idx = probs.topk(k_top, -1)  # [T, k]
        top[i] = idx.numpy().astype(np.int32)
        if norm_topk and mistake != "topk_not_renormalised":
            wt = wt / wt.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(E):
            rows, slot = torch.where(idx == e)
            if len(rows):
                ep = f"{m}experts.{e}."
                y = mlp(x[rows], w[ep + "gate_proj.weight"], w[ep + "up_proj.weight"], w[ep + "down_proj.weight"])
                out[rows] += wt[rows, slot][:, None] * y
        shared = mlp(x, w[m + "shared_expert.gate_proj.weight"], w[m + "shared_expert.up_proj.weight"],
                     w[m + "shared_expert.down_proj.weight"])
        sgate = torch.sigmoid(x @ w[m + "shared_expert_gate.weight"].T)  # [T, 1]
        h = h + out + (shared if mistake == "shared_gate_left_out" else sgate * shared)
    h = rms(h, eps) * (1 + w["model.norm.weight"])
    return (h @ w["lm_head.weight"].T).numpy(), top, min_gap


class RouterLog:
    """Forward hooks on every router (`mlp.gate`, output (logits, top-k weights, top-k indices)): keeps the last
    indices per layer, and per `phase` (a label the caller sets) the smallest gap between the k-th and (k+1)-th
    router probability of any token in any layer."""

    def __init__(self, model, k: int):
        self.k, self.indices, self.phase, self.gaps = k, {}, "", {}
        self.handles = [layer.mlp.gate.register_forward_hook(self.hook(i))
                        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]

    def hook(self, i: int):
        def fn(module, args, output):
            logits, weights, idx = output
            assert logits.dtype == torch.float32 and weights.dtype == torch.float32, (logits.dtype, weights.dtype)
            srt = logits.float().softmax(-1).sort(-1, descending=True).values
            gap = float((srt[:, self.k - 1] - srt[:, self.k]).min())
            self.gaps[self.phase] = min(self.gaps.get(self.phase, float("inf")), gap)
            self.indices[i] = idx.detach().clone().numpy().astype(np.int32)
        return fn


@torch.no_grad()
def make_fixture(kind: str, out_dir: str, seed: int) -> dict:
    name = {"moe": "hf_tiny_moe", "next": "hf_tiny_next"}[kind]
    cls = {"moe": Qwen3_5MoeForCausalLM, "next": Qwen3NextForCausalLM}[kind]
    print(f"\n===== {name} ({cls.__name__}) =====")
    torch.manual_seed(seed)
    cfg = make_config(kind)
    model = cls(cfg).to(torch.float32).eval()
    print(f"experts implementation by default: {model.get_experts_implementation()['']}")
    model.set_experts_implementation("eager")
    assert model.config._attn_implementation == "eager" and model.get_experts_implementation()[""] == "eager"
    perturb(model, torch.Generator().manual_seed(seed + 1))
    k_top, E = cfg.num_experts_per_tok, cfg.num_experts
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    print("mlp per layer:", kinds)
    if kind == "next":
        assert kinds[1] == "Qwen3NextMLP" and all(k == "Qwen3NextSparseMoeBlock" for j, k in enumerate(kinds) if j != 1)
    log = RouterLog(model, k_top)

    prompt = np.random.default_rng(seed).integers(2, VOCAB, size=PROMPT_LEN).astype(np.int32)
    ids = torch.from_numpy(prompt.astype(np.int64))[None]

    # 0. routers and shared-expert gates: the first draw whose routing of the prompt has no near tie
    for draw in range(100):
        perturb_moe(model, torch.Generator().manual_seed(seed + 2 + draw))
        log.phase = f"draw {draw}"
        model(ids, use_cache=False)
        print(f"router draw {draw} (generator seed {seed + 2 + draw}): smallest gap {log.gaps[log.phase]:.1e}")
        if log.gaps[log.phase] >= MIN_GAP:
            break
    else:
        raise SystemExit(f"no router draw without a gap below {MIN_GAP}")

    # 1. full forward, no cache; the routing of layer 0 from the hook
    log.phase = "full"
    logits_full = model(ids, use_cache=False).logits[0].float().numpy()
    top0 = log.indices[0].copy()
    hf_top_full = {i: v.copy() for i, v in log.indices.items()}
    assert top0.shape == (PROMPT_LEN, k_top), top0.shape
    std, tok_std = float(logits_full.std()), float(logits_full.std(axis=0).mean())
    print(f"logits_full std={std:.3f}  mean per-vocab std over positions={tok_std:.3f}  "
          f"|max|={np.abs(logits_full).max():.2f}")
    assert std > 0.5 and tok_std > 0.3, (std, tok_std)
    for i, v in sorted(hf_top_full.items()):
        counts = np.bincount(v.ravel(), minlength=E)
        print(f"layer {i} expert use (of {v.size} picks): {counts.tolist()}")
        assert (counts > 0).all() and counts.max() < 0.4 * v.size, counts
    pairs = {tuple(sorted(r)) for r in top0.tolist()}
    print(f"layer 0: {len(pairs)} distinct expert pairs over {PROMPT_LEN} tokens")

    # 2. token-by-token decode with the cache
    log.phase = "decode"
    out = model(ids[:, :1], use_cache=True)
    cache, rows = out.cache, [out.logits[0, -1]]
    for t in range(1, PROMPT_LEN):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0, -1])
    logits_decode = torch.stack(rows).float().numpy()

    # 3. prefix prefill + continuation in one call
    log.phase = "continue"
    out = model(ids[:, :PREFIX_LEN], use_cache=True)
    logits_continue = model(ids[:, PREFIX_LEN:], cache=out.cache, use_cache=True).logits[0].float().numpy()
    agreement = {}
    for nm, arr, want in (("decode", logits_decode, logits_full),
                          ("continue", logits_continue, logits_full[PREFIX_LEN:])):
        agreement[nm] = float(np.abs(arr - want).max())
        print(f"max|logits_{nm} - logits_full| = {agreement[nm]:.3e}"
              f" (at position {int(np.abs(arr - want).max(-1).argmax()) + (PREFIX_LEN if nm == 'continue' else 0)})")
        assert agreement[nm] < 3e-3, (nm, agreement[nm])

    # 4. greedy generate, no early stop on eos, and a manual argmax loop
    log.phase = "greedy"
    gp = ids[:, :GREEDY_PROMPT_LEN]
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=GREEDY_NEW, min_new_tokens=0, eos_token_id=None,
                            pad_token_id=0, bos_token_id=None)
    # generate() fills a None of `gcfg` from the model's own generation_config (eos_token_id 1 from config.json),
    # which would stop at token 1: clear it there too
    model.generation_config.eos_token_id = None
    greedy = model.generate(gp, generation_config=gcfg)[0, GREEDY_PROMPT_LEN:].numpy().astype(np.int32)
    assert greedy.shape == (GREEDY_NEW,), greedy.shape
    out = model(gp, use_cache=True)
    cache, manual = out.cache, []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(GREEDY_NEW):
        manual.append(nxt)
        out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        nxt = int(out.logits[0, -1].argmax())
    assert manual == greedy.tolist(), (manual, greedy.tolist())
    print(f"greedy ({GREEDY_NEW} new tokens after {GREEDY_PROMPT_LEN}): {greedy.tolist()}  "
          f"contains eos {EOS_ID}: {EOS_ID in greedy.tolist()}  distinct: {len(set(greedy.tolist()))}")

    # 5. one batch of four prompts, each row against the prompt alone
    rng, picked, tries = np.random.default_rng(seed + 1), [], 0
    while len(picked) < BATCH:
        cand = rng.integers(2, VOCAB, size=BATCH_LEN)
        log.phase, tries = f"pick {tries}", tries + 1
        model(torch.from_numpy(cand.astype(np.int64))[None], use_cache=False)
        if log.gaps[log.phase] >= MIN_GAP:
            picked.append(cand)
    print(f"batch prompts: kept {BATCH} of {tries} draws (router gap >= {MIN_GAP:g})")
    batch_ids = np.stack(picked).astype(np.int32)
    log.phase = "batch"
    bids = torch.from_numpy(batch_ids.astype(np.int64))
    batch_logits = model(bids, use_cache=False).logits.float().numpy()
    alone = np.stack([model(bids[b:b + 1], use_cache=False).logits[0].float().numpy() for b in range(BATCH)])
    agreement["batch"] = float(np.abs(batch_logits - alone).max())
    print(f"max|batch_logits - each prompt alone| = {agreement['batch']:.3e}")
    assert agreement["batch"] < 1e-4, agreement["batch"]
    gaps = {k: v for k, v in log.gaps.items() if not k.startswith(("pick", "draw"))}
    print("smallest router gap (k-th - (k+1)-th probability) per pass: "
          + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
    assert min(gaps.values()) > MIN_GAP / 2, gaps
    agreement["router_gap"] = min(gaps.values())

    # the default experts implementation (grouped_mm) next to the eager loop used here
    model.set_experts_implementation("grouped_mm")
    d_gmm = float(np.abs(model(ids, use_cache=False).logits[0].float().numpy() - logits_full).max())
    model.set_experts_implementation("eager")
    print(f"max|grouped_mm experts - eager experts| on logits_full = {d_gmm:.3e}")
    for h in log.handles:
        h.remove()

    # 6. save the checkpoint
    out_path = os.path.join(out_dir, name)
    os.makedirs(out_path, exist_ok=True)
    model.save_pretrained(out_path, safe_serialization=True)
    gen_cfg = os.path.join(out_path, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)  # not needed by the JAX loader; keep the fixture minimal
    st = os.path.join(out_path, "model.safetensors")
    os.chmod(st, 0o644)

    # 7. the saved tensors: per-expert names, and the same numbers as the fused parameters in memory
    from safetensors import safe_open
    with safe_open(st, framework="pt") as f:
        saved = {key: f.get_tensor(key) for key in f.keys()}
    I = cfg.moe_intermediate_size
    for i, layer in enumerate(model.model.layers):
        mp = f"model.layers.{i}.mlp."
        if not hasattr(layer.mlp, "experts"):
            assert not any(key.startswith(mp + "experts") for key in saved)
            continue
        assert mp + "experts.gate_up_proj" not in saved and mp + "experts.down_proj" not in saved
        gu, dn = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj  # [E, 2I, D], [E, D, I]
        for e in range(E):
            assert torch.equal(saved[f"{mp}experts.{e}.gate_proj.weight"], gu[e, :I])  # first half: gate
            assert torch.equal(saved[f"{mp}experts.{e}.up_proj.weight"], gu[e, I:])  # second half: up
            assert torch.equal(saved[f"{mp}experts.{e}.down_proj.weight"], dn[e])
    print(f"saved per expert: experts.{{e}}.gate_proj == gate_up_proj[e, :{I}], up_proj == gate_up_proj[e, {I}:], "
          f"down_proj == down_proj[e]")

    # 8. the independent float64 forward from the saved file, and the mistakes it would catch; then reference.npz
    with open(os.path.join(out_path, "config.json")) as fh:
        saved_cfg = json.load(fh)
    w64 = {key: v.double() for key, v in saved.items()}
    f64, top64, gap64 = independent_forward_f64(w64, saved_cfg, prompt)
    agreement["f64"] = float(np.abs(logits_full - f64).max())
    agreement["decode_f64"] = float(np.abs(logits_decode - f64).max())
    print(f"max|logits_full - independent f64| = {agreement['f64']:.3e}  (decode: {agreement['decode_f64']:.3e}); "
          f"f64 smallest router gap {gap64:.3e}")
    assert agreement["f64"] < 3e-3, agreement["f64"]
    for i, v in hf_top_full.items():
        assert np.array_equal(v, top64[i]), f"layer {i}: routing differs from the independent forward"
    mistakes = ["topk_not_renormalised", "shared_gate_left_out", "gate_up_swapped"]
    if kind == "next":
        mistakes.append("qkvz_read_as_qwen35")
    for mistake in mistakes:
        bad, _, _ = independent_forward_f64(w64, saved_cfg, prompt, mistake=mistake)
        d = float(np.abs(bad - logits_full).max())
        agreement[f"mistake_{mistake}"] = d
        print(f"  with the mistake {mistake}: max|diff| = {d:.3e}")
        assert d > 5e-2, (mistake, d)

    np.savez_compressed(
        os.path.join(out_path, "reference.npz"),
        prompt_ids=prompt,
        logits_full=logits_full.astype(np.float32),
        logits_full_f64=f64.astype(np.float32),  # rounded once: <= 6e-8 relative
        prefix_len=np.int32(PREFIX_LEN),
        logits_continue=logits_continue.astype(np.float32),
        logits_decode=logits_decode.astype(np.float32),
        greedy_prompt_len=np.int32(GREEDY_PROMPT_LEN),
        greedy_ids=greedy,
        batch_ids=batch_ids,
        batch_logits=batch_logits.astype(np.float32),
        router_top_experts_layer0=top0.astype(np.int32),
        seed=np.int32(seed),
        torch_version=np.array(torch.__version__),
        transformers_version=np.array(transformers.__version__),
    )

    # 9. from_pretrained round trip (per-expert tensors fused again on load)
    re = cls.from_pretrained(out_path, attn_implementation="eager", experts_implementation="eager",
                             dtype=torch.float32).eval()
    mine, loaded = model.state_dict(), re.state_dict()
    assert mine.keys() == loaded.keys() and all(torch.equal(mine[k], loaded[k]) for k in mine)
    d_rt = float(np.abs(re(ids, use_cache=False).logits[0].numpy() - logits_full).max())
    print(f"from_pretrained round trip: every parameter bit-equal, logits max diff = {d_rt:.3e}")
    assert d_rt < 1e-5, d_rt

    shapes = {key: tuple(v.shape) for key, v in saved.items()}
    print(f"\n{len(shapes)} tensors in model.safetensors ({os.path.getsize(st) / 1024:.1f} KiB):")
    for key in sorted(shapes):
        if ".experts." in key and not key.split(".experts.")[1].startswith("0."):
            continue
        print(f"  {key:55s} {shapes[key]}")
    print(f"  (experts 1..{E - 1} like experts.0)")
    print("\nconfig.json:", json.dumps(saved_cfg, sort_keys=True))
    print("\nfiles:")
    for fn in sorted(os.listdir(out_path)):
        data = Path(out_path, fn).read_bytes()
        print(f"  {fn:20s} {len(data) / 1024:.1f} KiB  sha256 {hashlib.sha256(data).hexdigest()[:16]}")
    return agreement


def main() -> None:
    ap = argparse.ArgumentParser(prog="make_hf_reference_moe.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures", help="folder that gets hf_tiny_moe/ and hf_tiny_next/")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the random weights and prompts")
    ap.add_argument("--only", choices=["moe", "next"],
                    help="write only this one of the two fixtures; both when left out")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    summary = {kind: make_fixture(kind, args.out, args.seed) for kind in (["moe", "next"] if args.only is None
                                                                             else [args.only])}
    print("\nsummary (max abs differences):")
    for kind, agreement in summary.items():
        print(f"  {kind}: " + ", ".join(f"{k} {v:.2e}" for k, v in agreement.items()))


if __name__ == "__main__":
    main()
