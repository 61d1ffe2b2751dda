"""Training path on the engine's own modules and parameters: a dense causal forward over whole sequences, the
next-byte loss, the corpus (the standard library's language and library reference), and a small training loop.

The forward here is the prefill the engine runs, without the serving machinery: full attention is a plain causal
softmax over the sequence (no paged KV cache), and every Gated DeltaNet layer runs the chunked gated delta rule from a
zero state. The layers are the `gdn_jax.model` modules themselves (merged from the same graphdef and params), so a
trained model loads into the engine unchanged; a test checks that the two forwards give the same logits.

Mixed precision: the optimiser keeps float32 master weights; `compute_dtype=bfloat16` casts them to bfloat16 for the
forward (matmuls accumulate in float32, norms, gates and the recurrent state stay float32). Matmuls alone run ~1.5x
faster in bfloat16 on the 2-core development CPU, but a training step of the small shipped `tiny` config only gains
~1.1-1.2x (median, scripts/bench/bench_train.py): the float32 gated delta rule and element-wise work dominate it.
`optax` is only needed for `make_optimizer` / `make_train_step` / `train` (the `train` extra).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.config import LINEAR, ModelConfig
from gdn_jax.model.dense import float32_precision
from gdn_jax.model.forms import Forms
from gdn_jax.tokenizer import ByteTokenizer
from gdn_jax.model.weights import abstract_model

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------------------------
# dense forward and loss
# ---------------------------------------------------------------------------------------------------------------


def training_forms() -> Forms:
    """The forms training traces in: on the CPU its forms of products and of the chunked GDN rule (the "fused"
    schedule), never the compiled kernels (no gradient) nor a machine's measured choices; elsewhere XLA's generic
    forms."""
    return Forms(cpu=jax.default_backend() == "cpu")


def dense_attention(attn, x, forms: Forms):
    """Causal gated full attention over whole rows, no cache. attn: a `model.Attention`; x: [B, T, D]."""
    cfg = attn.cfg
    B, T, _ = x.shape
    H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    q, k, v, gate = attn.project(x, positions, forms)
    q = q.reshape(B, T, kvh, H // kvh, hd)  # query head h reads kv head h // (H / kvh)
    precision = float32_precision(x.dtype)  # float32 products in float32 on a GPU too
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32, precision=precision) * hd**-0.5
    causal = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32,
                     precision=precision).astype(x.dtype)
    return attn.gated_output(out.reshape(B, T, H * hd), gate, forms)


def dense_forward(model, tokens, chunk_size: int = 32, forms: Forms | None = None):
    """tokens [B, T] int -> float32 logits [B, T, V]: every row is a whole sequence starting at position 0.
    `chunk_size` of the chunked gated delta rule (32 trains faster than 64 on CPU); `forms`, by default
    `training_forms()`."""
    forms = training_forms() if forms is None else forms
    return model.logits(dense_hidden(model, tokens, chunk_size, forms), forms)


def dense_hidden(model, tokens, chunk_size: int = 32, forms: Forms | None = None):
    """`dense_forward`'s last layer output [B, T, D], before the final norm."""
    forms = training_forms() if forms is None else forms
    x = model.embed_tokens[...][tokens]
    B = tokens.shape[0]
    for layer in model.layers:
        h = layer.input_layernorm(x)
        if layer.layer_type == LINEAR:
            cfg = layer.linear_attn.cfg
            conv0 = jnp.zeros((B, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), h.dtype)
            ssm0 = jnp.zeros((B, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
            h = layer.linear_attn(h, conv0, ssm0, None, chunk_size=chunk_size, forms=forms)[0]
        else:
            h = dense_attention(layer.self_attn, h, forms)
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x), forms)
    return x


def mtp_dense_forward(model, hidden, next_tokens, forms: Forms | None = None):
    """The MTP block (`model.mtp`) over whole rows: the main model's normed output hidden [B, T, D] at positions
    0..T-1 and the tokens that follow them, next_tokens [B, T] -> float32 logits [B, T, V] of the tokens after
    those."""
    forms = training_forms() if forms is None else forms
    x = model.mtp.inputs(model.embed_tokens[...][next_tokens], hidden, forms)
    for layer in model.mtp.layers:
        x = layer.residual(x, dense_attention(layer.self_attn, layer.input_layernorm(x), forms), forms)
    return model.head(model.mtp.norm(x), forms)


class MtpForward:
    """Training of the MTP block alone on a frozen model (Qwen3-Next's next-next-token loss): `loss(mtp, rest,
    tokens)`, where `mtp` and `rest` are the float32 params of the block and of everything else
    (`split_mtp`); the main model's hidden states carry no gradient."""

    def __init__(self, cfg: ModelConfig, compute_dtype=jnp.float32):
        from gdn_jax.model.qwen35 import Qwen35Model

        model = nnx.eval_shape(lambda: Qwen35Model(cfg, dtype=compute_dtype, rngs=nnx.Rngs(0)))
        self.graphdef, self.mtp_abstract, self.rest_abstract = nnx.split(model, nnx.PathContains("mtp"), ...)

    def model(self, mtp, rest):
        return nnx.merge(self.graphdef, cast_params(mtp, self.mtp_abstract), cast_params(rest, self.rest_abstract))

    def token_nats(self, mtp, rest, tokens):
        """Per-target cross entropy (nats) of predicting tokens[:, 2:] from the model's hidden states at
        tokens[:, :-2] and the tokens after them: [B, T - 2] float32."""
        model = self.model(mtp, rest)
        hidden = jax.lax.stop_gradient(model.norm(dense_hidden(model, tokens[:, :-2])))
        logp = jax.nn.log_softmax(mtp_dense_forward(model, hidden, tokens[:, 1:-1]), axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 2:, None], axis=-1)[..., 0]

    def loss(self, mtp, rest, tokens):
        return jnp.mean(self.token_nats(mtp, rest, tokens))


def split_mtp(params):
    """A model's params -> (its MTP block's, the rest), as `MtpForward` takes them."""
    flat = dict(nnx.to_flat_state(params))
    return tuple(nnx.from_flat_state({k: v for k, v in flat.items() if (k[0] == "mtp") == want})
                 for want in (True, False))


def mtp_heldout(cfg: ModelConfig, params, ids: np.ndarray, rows: int, window: int = 256) -> dict:
    """The MTP block teacher-forced on `rows` held-out windows: its next-next-token accuracy and bits per byte, and
    how often its argmax equals the main model's argmax at the next position (the acceptance of a one-token greedy
    draft, were the drafts made from the true tokens)."""
    from gdn_jax.model.qwen35 import Qwen35Model

    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Qwen35Model(cfg, rngs=nnx.Rngs(0)))), params)

    @jax.jit
    def one(tokens):
        hidden = dense_hidden(model, tokens)
        main = model.logits(hidden)  # predicts tokens[:, 1:]
        draft = mtp_dense_forward(model, model.norm(hidden[:, :-2]), tokens[:, 1:-1])  # predicts tokens[:, 2:]
        nats = -jnp.take_along_axis(jax.nn.log_softmax(draft, axis=-1), tokens[:, 2:, None], axis=-1)[..., 0]
        top = jnp.argmax(draft, axis=-1)
        return jnp.stack([jnp.mean(top == tokens[:, 2:]), jnp.mean(top == jnp.argmax(main[:, 1:-1], axis=-1)),
                          jnp.mean(nats) / LN2])

    n = min(rows, len(ids) // window)
    windows = np.asarray(ids[:n * window], np.int32).reshape(n, window)
    got = np.mean([np.asarray(one(windows[i:i + 8])) for i in range(0, n, 8)], axis=0)
    return {"next_next_accuracy": float(got[0]), "agrees_with_main_greedy": float(got[1]),
            "bits_per_byte": float(got[2]), "windows": int(n), "window": window}


def make_mtp_train_step(fwd: MtpForward, tx):
    """One jitted step of the MTP block: (mtp, opt_state, rest, tokens [B, T + 2]) -> (mtp, opt_state, loss)."""
    import optax

    def step(mtp, opt_state, rest, tokens):
        loss, grads = jax.value_and_grad(fwd.loss)(mtp, rest, tokens)
        updates, opt_state = tx.update(grads, opt_state, mtp)
        return optax.apply_updates(mtp, updates), opt_state, loss

    return jax.jit(step)  # (no donation: the masked optimizer state holds the block's 1-D params themselves)


def cast_params(params, abstract):
    """Casts float32 master params to the dtypes of `abstract` (the compute model's params) leaf by leaf."""
    return jax.tree.map(lambda p, a: p.astype(a.dtype), params, abstract)


class Forward:
    """The training forward for one config and compute dtype: `logits(params, tokens)` and `loss(params, tokens)`,
    where `params` are the float32 master params (an `nnx.State` of `abstract_model(cfg, float32)`)."""

    def __init__(self, cfg: ModelConfig, compute_dtype=jnp.float32):
        self.cfg, self.compute_dtype = cfg, compute_dtype
        self.graphdef, self.abstract = abstract_model(cfg, compute_dtype)

    def logits(self, params, tokens):
        return dense_forward(nnx.merge(self.graphdef, cast_params(params, self.abstract)), tokens)

    def token_nats(self, params, tokens):
        """Per-target cross entropy (nats) of predicting tokens[:, 1:] from their prefixes: [B, T - 1] float32."""
        logits = self.logits(params, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

    def loss(self, params, tokens):
        return jnp.mean(self.token_nats(params, tokens))

    @property
    def row_nats(self):
        """Jitted (params, tokens [B, T]) -> summed nats per row [B] (compiled once per Forward)."""
        if not hasattr(self, "_row_nats"):
            self._row_nats = jax.jit(lambda p, t: jnp.sum(self.token_nats(p, t), axis=1))
        return self._row_nats


def bits_per_byte(fwd: Forward, params, ids: np.ndarray, window: int, batch: int = 8) -> float:
    """Bits per byte of a held-out token stream: non-overlapping windows of `window` tokens, each read from a zero
    state; every token of a window but its first is a target (a short tail window is dropped)."""
    n = len(ids) // window
    if n == 0:
        raise ValueError(f"held-out stream of {len(ids)} tokens is shorter than one window of {window}")
    rows = np.asarray(ids[: n * window], np.int32).reshape(n, window)
    rows = np.concatenate([rows, np.repeat(rows[:1], -n % batch, 0)])  # pad to whole batches; padding not counted
    total = sum(float(fwd.row_nats(params, rows[i:i + batch])[:n - i].sum()) for i in range(0, n, batch))
    return total / (n * (window - 1)) / LN2


# ---------------------------------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Corpus:
    train: np.ndarray        # int32 token stream: documents separated by EOS
    heldout_text: str        # the fixed validation slice (plain text)
    num_docs: int
    num_bytes: int           # UTF-8 bytes of the whole corpus (train + held-out)

    @property
    def heldout(self) -> np.ndarray:
        return encode(self.heldout_text)


def encode(text: str) -> np.ndarray:
    return np.asarray(ByteTokenizer(512).encode(text), np.int32)


def reference_documents() -> list[str]:
    """The language and library reference topics that ship with every Python (`pydoc_data.topics`), by topic name."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def load_corpus(heldout_bytes: int = 32768, heldout_at: float = 0.9) -> Corpus:
    """Documents joined with EOS; a fixed slice of `heldout_bytes` characters starting at fraction `heldout_at` of the
    text (cut at line starts) is held out, and the text on either side of it (joined without an EOS) trains."""
    docs = reference_documents()
    eos = chr(0)  # placeholder for EOS while slicing text; topics contain no NUL
    text = eos.join(docs) + eos
    start = text.index("\n", int(len(text) * heldout_at)) + 1
    end = text.index("\n", start + heldout_bytes) + 1
    heldout = text[start:end].replace(eos, "\n")
    ids = []
    for part in (text[:start], text[end:]):
        for j, doc in enumerate(part.split(eos)):
            if j:
                ids.append(ByteTokenizer.EOS)
            ids.extend(encode(doc).tolist())
    return Corpus(np.asarray(ids, np.int32), heldout, len(docs), len(text.encode()) - text.count(eos))


def sample_batch(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """[batch, seq_len + 1] random windows of the stream; depends only on (seed, step), so a resumed run sees the
    same data as an uninterrupted one."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return np.stack([stream[s:s + seq_len + 1] for s in starts])


# ---------------------------------------------------------------------------------------------------------------
# optimisation
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainConfig:
    """Optimisation settings; the defaults are those of the shipped `tiny` run (scripts/tools/train_tiny.py)."""
    steps: int = 1200
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    compute_dtype: str = "bfloat16"
    eval_every: int = 200
    log_every: int = 10
    eval_window: int = 256
    ckpt_every: int = 200


def make_optimizer(tc: TrainConfig):
    """AdamW with warm-up and cosine decay, global-norm clipping; no decay on norms, biases and gates (1-D params)."""
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1),
                                               tc.lr * tc.min_lr_ratio)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask)), sched


def make_train_step(fwd: Forward, tx):
    """One jitted step: (params, opt_state, tokens [B, T+1]) -> (params, opt_state, loss), buffers donated."""
    import optax

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(fwd.loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# The TrainConfig fields the optimizer, so the jitted step, depends on (beside the model config and compute dtype)
OPTIMIZER_FIELDS = ("steps", "lr", "min_lr_ratio", "warmup", "weight_decay", "clip")


@functools.lru_cache(maxsize=8)
def forward_for(cfg: ModelConfig, compute_dtype: str) -> Forward:
    """The `Forward` of a config and compute dtype ("float32" or "bfloat16"), one per process: its jitted
    evaluation is traced and compiled once, however many runs (a notebook's re-run cell, a resume) evaluate."""
    return Forward(cfg, jnp.bfloat16 if compute_dtype == "bfloat16" else jnp.float32)


@functools.lru_cache(maxsize=8)
def _step_for(cfg: ModelConfig, compute_dtype: str, optimizer: tuple):
    tc = TrainConfig(**dict(zip(OPTIMIZER_FIELDS, optimizer)))
    return make_train_step(forward_for(cfg, compute_dtype), make_optimizer(tc)[0])


def train_step_for(cfg: ModelConfig, tc: TrainConfig):
    """`make_train_step` of the config's `forward_for` and `tc`'s optimizer, one per process for the same settings:
    a second run (a resume, a re-run) calls the step the first one compiled."""
    return _step_for(cfg, tc.compute_dtype, tuple(getattr(tc, f) for f in OPTIMIZER_FIELDS))


def init_params(cfg: ModelConfig, seed: int = 0):
    """Float32 master params for training: normal(0.02) projections, zero-centred norms at identity, the GDN decay
    rates of `model.Qwen35Model`; output projections scaled down by sqrt(2 * layers) (residual-stream init)."""
    from gdn_jax.model.qwen35 import Qwen35Model

    model = Qwen35Model(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed), std=0.02)
    scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    for layer in model.layers:
        mixer = layer.linear_attn.out_proj if layer.layer_type == LINEAR else layer.self_attn.o_proj
        for proj in (mixer, layer.mlp.down_proj):
            proj.kernel[...] = proj.kernel[...] * scale
    return nnx.split(model)[1]


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def steady_tokens_per_s(history: list[dict], tokens_per_step: int) -> float:
    """Median training throughput over the logged intervals (robust to the few that hold a compilation or a resume),
    leaving out those that start at an evaluation row (the evaluation runs after the row's time is taken)."""
    rates = [(b["step"] - a["step"]) * tokens_per_step / (b["time"] - a["time"])
             for a, b in zip(history, history[1:]) if "val_bpb" not in a and b["time"] > a["time"]]
    return float(np.median(rates)) if rates else float("nan")


# TrainConfig fields a resumed run may change: they decide when it logs, evaluates and checkpoints, not what it trains
RESUME_MAY_CHANGE = ("eval_every", "log_every", "ckpt_every")


def run_settings(cfg: ModelConfig, tc: TrainConfig, corpus: Corpus) -> dict:
    """What makes a training run the run it is, as JSON: the model config (its name aside), the optimisation settings
    (`RESUME_MAY_CHANGE` aside) and fingerprints of the corpus's training stream and held-out slice. Every checkpoint
    records it; a resume with other settings is refused."""
    digest = lambda b: hashlib.sha256(b).hexdigest()[:16]  # noqa: E731
    return json.loads(json.dumps({
        "model": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"},
        "train": {k: v for k, v in dataclasses.asdict(tc).items() if k not in RESUME_MAY_CHANGE},
        "corpus": {"train": digest(np.asarray(corpus.train, np.int32).tobytes()),
                   "heldout": digest(corpus.heldout_text.encode())}}))


def _settings_changed(saved: dict, now: dict) -> list[str]:
    """'section.field old -> new' for every setting that differs."""
    return [f"{section}.{k} {saved.get(section, {}).get(k)!r} -> {now[section].get(k)!r}"
            for section in now for k in sorted(set(now[section]) | set(saved.get(section, {})))
            if saved.get(section, {}).get(k) != now[section].get(k)]


def train(cfg: ModelConfig, tc: TrainConfig, corpus: Corpus, ckpt_dir: str | Path | None = None,
          resume: bool = False, stop_after: int | None = None, log: Callable[[str], None] = print) -> dict:
    """Trains from scratch (or from the latest orbax checkpoint in `ckpt_dir` with `resume`) and returns
    {"params", "history", "start_step", "end_step", "wall_s", "tokens_per_s", ...}. `stop_after` ends this run after
    that many steps (the schedule still spans `tc.steps`), as an interruption would; the last step is checkpointed.
    History rows (every `log_every` steps, and at evaluations, checkpoints and the last step): step, loss (nats per
    token, the mean over the steps since the previous row), lr (the rate the row's last step trained with: optax's
    schedule at that step's 0-based index), time (wall seconds since step 0, resumed runs, evaluations and the first
    step's compilation included) and val_bpb at the evaluation steps.
    A `ckpt_dir` that holds checkpoints belongs to the run that wrote them: a run from scratch refuses it (ValueError;
    orbax would skip every save at or below their latest step, and a later resume would continue the earlier run),
    and so does a resume whose settings (`run_settings`) differ from those its checkpoint records."""
    heldout = corpus.heldout
    top = int(max(corpus.train.max(initial=0), heldout.max(initial=0)))
    if top >= cfg.vocab_size:  # an embedding row it does not have: NaN losses
        raise ValueError(f"vocab_size {cfg.vocab_size} does not cover the corpus: it holds token id {top} (byte b is "
                         f"id b + {ByteTokenizer.OFFSET}, so a byte-level vocabulary needs {256 + ByteTokenizer.OFFSET})")
    if len(heldout) < tc.eval_window:
        raise ValueError(f"eval_window {tc.eval_window} is longer than the held-out slice of {len(heldout)} tokens")
    fwd = forward_for(cfg, tc.compute_dtype)
    tx, sched = make_optimizer(tc)
    history, start = [], 0
    mngr, latest, settings = None, None, run_settings(cfg, tc, corpus)
    if ckpt_dir is not None:
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))
        latest = mngr.latest_step()
        if latest is not None and not resume:
            raise ValueError(f"checkpoint folder {ckpt_dir} holds an earlier run (latest step {latest}): resume it, "
                             f"or train from scratch into an empty folder")
        if latest is not None and (Path(ckpt_dir) / str(latest) / "run").exists():
            saved = mngr.restore(latest, args=ocp.args.Composite(run=ocp.args.JsonRestore())).run
            changed = _settings_changed(saved, settings)
            if changed:
                raise ValueError(f"checkpoint folder {ckpt_dir} holds a run with other settings; resuming it with "
                                 f"these would not continue it: {', '.join(changed)}")
    params = init_params(cfg, tc.seed)
    # committed to the device, as orbax's restored arrays are: a resumed run calls the program a fresh run compiled
    params, opt_state = jax.device_put((params, tx.init(params)), jax.devices()[0])
    if mngr is not None:
        if resume and latest is not None:
            start = latest
            restored = mngr.restore(start, args=ocp.args.Composite(
                state=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}),
                history=ocp.args.JsonRestore()))
            params, opt_state = restored.state["params"], restored.state["opt_state"]
            history = list(restored.history)
            log(f"resumed from step {start}")
    step_fn = train_step_for(cfg, tc)
    t0, t_eval, t_compile, pending = time.perf_counter(), 0.0, 0.0, []
    t_before = history[-1]["time"] if history else 0.0
    end = tc.steps if stop_after is None else min(tc.steps, start + stop_after)
    for step in range(start, end):
        batch = sample_batch(corpus.train, step, tc.batch, tc.seq_len, tc.seed)
        params, opt_state, loss = step_fn(params, opt_state, batch)
        pending.append(loss)
        done = step + 1
        if step == start:  # the first step compiles: kept out of the throughput
            jax.block_until_ready(loss)
            t_compile = time.perf_counter() - t0
        checkpoint = mngr is not None and (done % tc.ckpt_every == 0 or done == end)
        # a checkpoint step logs too, so that the history it saves holds every step's loss up to it
        if done % tc.log_every == 0 or done == end or done % tc.eval_every == 0 or checkpoint:
            mean = float(np.mean(jax.device_get(pending)))
            pending = []
            row = {"step": done, "loss": mean, "lr": float(sched(done - 1)), "time": t_before + time.perf_counter() - t0}
            if done % tc.eval_every == 0 or done == tc.steps:
                te = time.perf_counter()
                row["val_bpb"] = bits_per_byte(fwd, params, heldout, tc.eval_window)
                t_eval += time.perf_counter() - te
            history.append(row)
            log(f"step {done:>6}  loss {mean:.4f} nats ({mean / LN2:.3f} bits)  lr {row['lr']:.2e}"
                + (f"  val {row['val_bpb']:.3f} bits/byte" if "val_bpb" in row else "")
                + f"  {time.perf_counter() - t0:.0f} s")
        if checkpoint:
            import orbax.checkpoint as ocp

            mngr.save(done, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                history=ocp.args.JsonSave(history), run=ocp.args.JsonSave(settings)))
    jax.block_until_ready(params)
    if mngr is not None:
        mngr.wait_until_finished()
    wall = time.perf_counter() - t0
    steps_run = end - start
    train_s = wall - t_eval - t_compile
    tps = (steps_run - 1) * tc.batch * tc.seq_len / train_s if steps_run > 1 and train_s > 0 else float("nan")
    return {"params": params, "history": history, "start_step": start, "end_step": end, "wall_s": t_before + wall,
            "eval_s": t_eval, "compile_s": t_compile, "tokens_per_s": tps, "forward": fwd}
