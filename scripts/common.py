"""What the scripts share; not a command. Each script puts scripts/ on sys.path and imports this module by name.

- the command line: the studies' flags (`study_parser`, `parse`), dtype lists, the entry `run_command`;
- results: JSON (`write_json`), figures drawn without a display (`figure`, `save`), the run's `environment`;
- timing: `best_time`, `min_median_time`, `BlockTimer` and `Stub` (stand-ins for the worker's step functions,
  `Worker.replace_functions`);
- the work of a step: `decode_bytes`, `forward_flops`, `projection_shapes`, and the machine's rates
  (`measure_read_bandwidth`, `matmul_peak`);
- one-row forwards outside the engine (`one_row_batch`, `forward_jit`) and workers on abstract weights
  (`build_worker`, `parse_shapes`);
- where a jitted step's time goes: XLA op times from a JAX profiler trace (`trace_events`, `self_times`), each op's
  kind (`op_kind`) and its part of the model (`op_parts`, `PARTS`);
- the transformers reference fixtures' command line and weights (`reference_args`, `perturb`; they need torch).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gzip
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.config import FULL, LINEAR, PRESETS, EngineConfig, ModelConfig, get_preset
from gdn_jax.entrypoints.cli import HelpFormatter, writable_file
from gdn_jax.backends.cpu import tuning
from gdn_jax.model.dense import dense
from gdn_jax.model.forms import Forms
from gdn_jax.model.layers import fused_parts
from gdn_jax.model.qwen35 import forward
from gdn_jax.model.state import Batch
from gdn_jax.model.weights import abstract_model, model_folder
from gdn_jax.worker import executable_store as executables
from gdn_jax.worker.compilation import (DECODE_VECTOR_BITS, compiler_options, executable_kind,
                                        vector_width_options)
from gdn_jax.worker.memory import GPU_MEMORY_UTILIZATION, default_memory_budget, plan_memory
from gdn_jax.worker.speculation import SpecWorker
from gdn_jax.worker.worker import Worker

ROOT = Path(__file__).resolve().parent.parent  # the repository
DEFAULT_MODEL = "tiny"  # the trained built-in model
DTYPES = ("float32", "bfloat16")


# ---- the command line ---------------------------------------------------------------------------------------------
def dtype_names(text: str) -> list[str]:
    """An argparse type: comma-separated dtypes the engine runs (`DTYPES`), e.g. "float32,bfloat16"; checked when
    parsed, so that a benchmark refuses a wrong one before it has run the others."""
    names = text.split(",")
    wrong = [n for n in names if n not in DTYPES]
    if wrong:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, wrong))}: expected {' or '.join(DTYPES)}")
    return names


def study_parser(prog: str, doc: str, outputs: str, quick: str, *, model_default: str | None = DEFAULT_MODEL,
                 model_help: str = "preset name or HF folder", dtypes: tuple[str, ...] = DTYPES,
                 model_aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The parser with the four flags of every study; the script adds its own. `doc` (the module docstring) is the
    description; `outputs` names the files written under --out; `quick` says what --quick shrinks."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
    ap.add_argument("--model", *model_aliases, default=model_default, help=model_help)
    ap.add_argument("--dtype", default="float32", choices=list(dtypes), help="weights and activations")
    ap.add_argument("--out", default="results", help=f"folder for {outputs}")
    ap.add_argument("--quick", action="store_true", help=f"{quick} (a test runs this)")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None, files: tuple[str, ...] = ()) -> argparse.Namespace:
    """`ap.parse_args(argv)`, then --out made ready before anything runs: a folder that cannot be written, or one of
    the `files` the study writes there that cannot be (a folder of that name), ends the run now (an argparse error
    naming it), not after the study has run. Tried by writing (`gdn_jax.entrypoints.cli.writable_file`): permission
    bits alone pass root on a read-only file system."""
    args = ap.parse_args(argv)
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out}: {e.strerror or e}")
    for name in files or (".write-probe",):
        problem = writable_file(Path(args.out) / name)
        if problem:
            ap.error(f"--out {args.out}: {Path(args.out) / name} {problem}")
    return args


def model_config(model: str) -> ModelConfig | None:
    """`model`'s `ModelConfig` read from its config alone (no weights), so that a study can check its settings against
    the model before it builds an engine; None for a name the engine will refuse with its own error."""
    if model in PRESETS:
        return PRESETS[model]
    folder = model_folder(model)
    return ModelConfig.from_pretrained(folder) if folder is not None and (folder / "config.json").is_file() else None


def check_length(ap: argparse.ArgumentParser, model: str, needed: int, flags: str) -> None:
    """An argparse error naming `flags` when the sequences they ask for (`needed` tokens, the engines' max_model_len)
    pass the model's positions: the engine's own error names only max_model_len, which no study takes."""
    cfg = model_config(model)
    if cfg is not None and needed > cfg.max_position_embeddings:
        ap.error(f"{flags}: sequences of up to {needed} tokens, beyond the {cfg.max_position_embeddings} positions of "
                 f"model {model}")


def fit_model_len(model: str, default: int) -> int:
    """A study's max_model_len: `default`, or the model's positions where it has fewer (said on stdout), since the
    engine refuses a max_model_len beyond them. The study checks first (`check_length`) that its sequences fit."""
    cfg = model_config(model)
    if cfg is None or cfg.max_position_embeddings >= default:
        return default
    print(f"max_model_len {cfg.max_position_embeddings}: the positions of model {model}, fewer than the study's "
          f"{default}")
    return cfg.max_position_embeddings


def run_command(main) -> None:
    """A script's command-line entry: a bad setting that the engine or the workload finds (a ValueError naming it)
    ends the run with `error: ...` and exit status 2, not a traceback."""
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def share_of(engines: int) -> dict:
    """`LLMEngine` arguments that give one of `engines` engines built side by side in this process its part of the
    default accelerator memory (`gpu_memory_utilization` is per engine; the CPU's budget is fixed, so this changes
    nothing there). An engine built with `pools_of` another's needs none: its pools are as large."""
    return {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION / engines}


def pools_of(engine) -> dict:
    """`LLMEngine` arguments for pools of the same sizes as `engine`'s. Engines of one model whose pools have the same
    shapes run the same compiled steps: a study that compares engines (cache on / off, reuse modes) then compiles
    each step shape once, not once per engine. With the prefix cache off the extra linear slots just stay free."""
    return {"num_kv_blocks": engine.memory.num_kv_blocks, "num_linear_slots": engine.memory.num_linear_slots}


# ---- results ------------------------------------------------------------------------------------------------------
def environment() -> dict:
    """What a run needs beside its settings to be reproduced: the package, its git commit (when run from a
    checkout), JAX and the backend it ran on, Python, the machine."""
    from importlib import metadata

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    try:
        version = metadata.version("gdn-jax")
    except metadata.PackageNotFoundError:
        version = None
    return {"gdn_jax": version, "git_commit": commit, "git_dirty": dirty, "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib"), "backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.devices()], "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count()}


def write_json(out: str | Path, name: str, result: dict) -> Path:
    """Writes `result` to OUT/name (creating OUT) and returns the path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def figure(figsize: tuple[float, float], ax=None):
    """The figure and axes a study plot draws on: `ax`'s if given (a notebook passes `plt.subplots()`'s, which it
    shows inline), else a new figure made without pyplot, so that a headless script neither needs nor changes a
    backend."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def save(fig, path: str | Path | None) -> None:
    """Saves a `figure()` as PNG (dpi 120) when a path is given; figures made here need no closing."""
    if path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)


# ---- timing -------------------------------------------------------------------------------------------------------
def median(values: list):
    """The median of the values that are not None (None: none is)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile_ms(seconds: list, q: float) -> float | None:
    """The q-th percentile of durations in seconds, in milliseconds (None: no durations)."""
    return 1e3 * float(np.percentile(seconds, q)) if seconds else None


def best_time(fn, *args, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn(*args) (waited for), after one untimed call."""
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def min_median_time(fn, repeats: int) -> tuple[float, float]:
    """The minimum and the median seconds of `repeats` calls of fn(), after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


class BlockTimer:
    """Wraps one of the worker's jitted step functions: after each (asynchronous) call returns, waits for its outputs
    and records how long the host was blocked on the device (`blocked`), and how long the whole call took, dispatch
    included (`calls`). Anything else the worker asks of it, the wrapped function answers."""

    def __init__(self, fn, blocked: list | None = None, last: list | None = None, calls: list | None = None):
        self.fn, self.blocked = fn, [] if blocked is None else blocked
        self.last = [None] if last is None else last  # [(fn, args)] of the last call (shareable, like blocked)
        self.calls = [] if calls is None else calls

    def __call__(self, *args):
        self.last[0] = (self.fn, args)
        start = time.perf_counter()
        out = self.fn(*args)
        t0 = time.perf_counter()
        jax.block_until_ready(out)
        self.blocked.append(time.perf_counter() - t0)
        self.calls.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name):  # lower, the cache size
        return getattr(self.fn, name)


class Stub:
    """Stands in for one of the worker's jitted step functions, `fn`: a call runs `body` instead; anything else the
    worker asks of it, `fn` answers."""

    def __init__(self, fn, body):
        self.fn, self.body = fn, body

    def __call__(self, *args):
        return self.body(*args)

    def __getattr__(self, name):
        return getattr(self.fn, name)


# ---- the work of a step, and the machine's rates ------------------------------------------------------------------
def decode_bytes(engine, batch: int, context: int) -> dict:
    """Bytes one decode step of `batch` rows at `context` tokens must move (a memory-bandwidth bound's numerator)."""
    cfg = engine.cfg
    pure = nnx.to_pure_dict(engine.worker.params)
    weights = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(pure))
    itemsize = pure["embed_tokens"].dtype.itemsize  # the activation dtype
    emb = cfg.vocab_size * cfg.hidden_size * itemsize
    if not cfg.tie_word_embeddings:  # only the batch's embedding rows are read; a tied table is the lm_head
        weights = weights - emb + batch * cfg.hidden_size * itemsize
    kv = 2 * len(cfg.full_layer_ids) * batch * context * cfg.num_key_value_heads * cfg.head_dim * itemsize
    per_row_state = ((cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * itemsize
                     + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    state = 2 * len(cfg.linear_layer_ids) * batch * per_row_state  # read and written
    return {"weights": weights, "kv": kv, "linear_state": state, "total": weights + kv + state}


def forward_flops(cfg, T: int, chunk: int = 64) -> dict:
    """Matmul FLOPs of a T-token prefill forward that returns the last position's logits: the last layer's MLP and,
    a full-attention layer, its attention and output projection at that position only (`Qwen35Model.last_layer_tail`;
    a GDN layer's mixer runs whole)."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    H, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mlp = 3 * D * I
    mixer_in = {FULL: D * (2 * H * hd + 2 * kvh * hd),               # q (+ gate), k, v
                LINEAR: D * (2 * hk * dk + 2 * hv * dv + 2 * hv)}    # q, k, v, z, a, b
    mixer_out = {FULL: H * hd * D, LINEAR: hv * dv * D}              # o, out
    *layers, last = cfg.layer_types
    every, once = mixer_in[last], mlp  # the last layer's matrices at every position, and at the last one only
    if last == FULL:
        once += mixer_out[FULL]
    else:  # a GDN layer's output projection runs inside its mixer, at every position
        every += mixer_out[LINEAR]
    dense_flops = (2 * T * (sum(mixer_in[t] + mixer_out[t] + mlp for t in layers) + every) + 2 * once
                   + 2 * D * cfg.vocab_size)
    per_key = 2 * 2 * H * hd  # scores + values, per query and key
    attention = sum(per_key * T * (T + 1) / 2 for t in layers if t == FULL) + (per_key * T if last == FULL else 0)
    # chunked delta rule per token and value head: K K^T, A K, A V, Q K^T, attn V within the chunk (6 C dk + 4 C dv)
    # and the state products Q S, K S, K^T U (6 dk dv)
    gdn = len(cfg.linear_layer_ids) * T * hv * (6 * chunk * dk + 4 * chunk * dv + 6 * dk * dv)
    return {"dense": dense_flops, "attention": attention, "gdn": gdn, "total": dense_flops + attention + gdn}


def measure_read_bandwidth(mib: int = 512, repeats: int = 7) -> dict:
    """Read bandwidth (bytes/s) of streaming kernels over `mib` MiB of float32: a column sum ("sum"), a vector-matrix
    product ("gemv", XLA's library routine) and, on the CPU, the engine's own one-row product (`model.dense` of one
    row: XLA's loop over the weight's rows, the form in which a decode step streams its weights) compiled with the
    LLVM IR emitters at 256- and 512-bit vectors ("rows_256", "rows_512"). "best": the fastest of them, the rate this
    machine is shown to read at."""
    n = mib * (1 << 20) // 4
    x = jnp.ones((n // 4096, 4096), jnp.float32)
    v = jnp.ones((1, n // 4096), jnp.float32)
    probes = {"sum": jax.jit(lambda a: jnp.sum(a, axis=0)), "gemv": jax.jit(lambda a, b: b @ a)}
    out = {}
    for name, fn in probes.items():
        args = (x,) if name == "sum" else (x, v)
        out[name] = x.nbytes / best_time(fn, *args, repeats=repeats)
    if jax.default_backend() == "cpu":
        w, row = x.reshape(-1, 2048), jnp.ones((1, 2048), jnp.float32)  # rows under model.FUSED_MATVEC_COLUMNS
        forms = tuning.product_forms(jnp.float32)  # the engine's CPU forms of a float32 product
        lowered = jax.jit(lambda x, w: dense(x, w, forms)).lower(row, w)
        for bits in DECODE_VECTOR_BITS:
            fn = lowered.compile(vector_width_options(bits))
            out[f"rows_{bits}"] = x.nbytes / best_time(fn, row, w, repeats=repeats)
    out["best"] = max(out.values())
    return out


def projection_shapes(cfg) -> list[tuple[int, int, int]]:
    """(n_in, n_out, layers) of each projection matmul of the forward (the fused matrices, as the engine runs them)."""
    parts = fused_parts(cfg)
    width = {name: sum(n for _, n in p) for sub in parts.values() for name, p in sub.items()}
    n_full, n_lin = len(cfg.full_layer_ids), len(cfg.linear_layer_ids)
    D = cfg.hidden_size
    shapes = [(D, width["gate_up_proj"], cfg.num_hidden_layers), (cfg.intermediate_size, D, cfg.num_hidden_layers),
              (D, width["in_proj"], n_lin), (cfg.linear_value_dim, D, n_lin),
              (D, width["qkv_proj"], n_full), (cfg.num_attention_heads * cfg.head_dim, D, n_full)]
    return [s for s in shapes if s[2]]


def matmul_peak(cfg, T: int, dtype, repeats: int = 5) -> dict:
    """The measured matmul peak on the forward's own projection shapes: a bare jitted x [T, n_in] @ w [n_in, n_out]
    (the plain contraction, which XLA's CPU backend gives its matmul library at any row count above one),
    accumulated in float32, per shape (best of `repeats`), and the FLOP-weighted rate of the forward's mix (its
    projection FLOPs / the sum of their times). A 16-bit dtype's product is also timed with both operands converted
    to float32 first (conversion included; what the engine's `dense` does with many rows on CPU), and the faster
    form counts (`form` per shape)."""
    rng = np.random.default_rng(0)
    forms = {"direct": jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))}
    if jnp.dtype(dtype).itemsize < 4:
        forms["upcast"] = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    per_shape, flops, seconds = [], 0.0, 0.0
    for n_in, n_out, layers in projection_shapes(cfg):
        x = jnp.asarray(rng.standard_normal((T, n_in)), dtype)
        w = jnp.asarray(rng.standard_normal((n_in, n_out)), dtype)
        best, form = min((best_time(fn, x, w, repeats=repeats), name) for name, fn in forms.items())
        fl = 2.0 * T * n_in * n_out
        per_shape.append({"n_in": n_in, "n_out": n_out, "layers": layers, "s": best, "gflops": fl / best / 1e9,
                          "form": form})
        flops, seconds = flops + layers * fl, seconds + layers * best
    return {"gflops": flops / seconds / 1e9, "per_shape": per_shape}


# ---- forwards and workers outside the engine ----------------------------------------------------------------------
def one_row_batch(tokens, block_size: int) -> tuple[Batch, int]:
    """The `Batch` of one cold row of `tokens` from position 0 (its KV in blocks 1.., its state in slot 1), and the
    number of KV blocks it fills."""
    T = len(tokens)
    nb = -(-T // block_size)
    return Batch(tokens=jnp.asarray(tokens, jnp.int32)[None], start_pos=jnp.zeros(1, jnp.int32),
                 lengths=jnp.asarray([T], jnp.int32), block_tables=jnp.arange(1, nb + 1, dtype=jnp.int32)[None],
                 slot_mapping=jnp.asarray(np.arange(T) + block_size, jnp.int32)[None],
                 linear_state_ids=jnp.ones(1, jnp.int32), has_initial_state=jnp.zeros(1, bool)), nb


def forward_jit(tokens: int, forms: Forms, options: dict | None = None):
    """The jitted forward in `forms` (the engine's: `tuning.resolve_forms(dtype)`), with the XLA options of the
    engine's step of one row of `tokens` tokens (`compiler_options`) unless `options` are given."""
    return jax.jit(functools.partial(forward, forms=forms), static_argnums=(0, 4), donate_argnums=(3,),
                   compiler_options=compiler_options(executable_kind(1, tokens), forms) if options is None else options)


def parse_shapes(text: str, flag: str = "--shapes") -> list[tuple[int, int, int]]:
    """Step shapes "ROWSxTOKENSxBLOCKS,..." -> [(rows, tokens, blocks)]; a ValueError naming `flag` otherwise."""
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        shapes = None
    if not shapes or any(len(s) != 3 for s in shapes):
        raise ValueError(f"{flag}: expected ROWSxTOKENSxBLOCKS,... (e.g. 16x64x256,1x1x8), got {text!r}")
    return shapes


def build_worker(a) -> Worker:
    """A worker as the engine builds it, on abstract weights (nothing allocated), from the flags `a` (preset, dtype,
    block_size, max_num_seqs, max_model_len, chunk_stride, max_num_batched_tokens, checkpoint_mode and _policy;
    `speculative_tokens`, where `a` has it and it is not 0: the speculating worker, the model with its MTP block)."""
    cfg = get_preset(a.preset)
    k = getattr(a, "speculative_tokens", 0)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    if spec:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=cfg.mtp_num_hidden_layers or 1)
    settings = EngineConfig.create(
        dtype=a.dtype, block_size=a.block_size, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
        chunk_stride=a.chunk_stride, max_num_batched_tokens=a.max_num_batched_tokens,
        checkpoint_mode=a.checkpoint_mode, checkpoint_policy=a.checkpoint_policy, speculative_config=spec)
    graphdef, params = abstract_model(cfg, getattr(jnp, a.dtype))
    params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return (SpecWorker if spec else Worker)(cfg, graphdef, params,
                                            plan_memory(cfg, settings, default_memory_budget(params_bytes)), settings)


# ---- where a jitted step's time goes ------------------------------------------------------------------------------
# Parts (`op_parts`, the innermost function of an op's call stack that names one):
# - projections: the layers' projection and MLP matmuls (`Linear.__call__`);
# - gdn_rule: the gated delta rule (chunked, or the decode step's recurrent one);
# - conv: the causal depthwise conv of the GDN layers (`causal_conv1d`);
# - gdn_state: the GDN conv and SSM states read from and written to their pools (restores, checkpoint saves, and the
#   decode step's loop that advances the states in place, bar its rule; with the compiled CPU kernel that whole
#   update, its rule included: one op);
# - attention: the full-attention layers' scores, softmax and values, the KV cache writes and reads, RoPE;
# - norms_elementwise: RMS norms, gates, activations, residual adds, the GDN input gates, dtype conversions;
# - logits: the final norm and LM head;
# - other: everything else (embedding gather, layer-loop bookkeeping).
PARTS = ("projections", "gdn_rule", "conv", "gdn_state", "attention", "norms_elementwise", "logits", "other")
# innermost function of an op's call stack -> part (the first listed one met walking outwards); a projection matmul is
# any op under `Linear.__call__`, the LM head any other op under the dense product (`PRODUCT_FUNCTION`; and the rest
# of the head's product, such as the padding of a wide one-row product to two rows, under `Qwen35Model.logits`)
FUNCTION_PARTS = {
    "Qwen35Model.logits": "logits",
    "causal_conv1d": "conv",
    "l2norm": "norms_elementwise",
    "chunk_gated_delta_rule": "gdn_rule",
    "recurrent_gated_delta_rule": "gdn_rule",
    "token_step": "gdn_rule",
    "new_state": "gdn_rule",
    "decode_token": "gdn_rule",
    "gdn_prefill": "gdn_rule",  # the CPU kernel of prefill steps
    "advance_in_pool.<locals>.body": "gdn_state",
    "advance_in_pool": "gdn_state",
    "Qwen35Model.__call__.<locals>.linear": "gdn_state",
    "rope": "attention",
    "Attention.__call__": "attention",
    "Attention.project_write": "attention",
    "Attention.attend": "attention",
    "RMSNorm.__call__": "norms_elementwise",
    "GatedRMSNorm.__call__": "norms_elementwise",
    "MLP.__call__": "norms_elementwise",
    "DecoderLayer.residual": "norms_elementwise",
    "GatedDeltaNet.__call__": "norms_elementwise",
}
PRODUCT_FUNCTION = "_product"  # the name XLA's call stacks give the dense product of gdn_jax/model/dense.py
CONTAINERS = ("while", "conditional", "call")  # ops whose time is their bodies' ops


def compiled_text(fn, args) -> str:
    """The compiled text of jitted fn for the shapes of `args` (donated arrays included: only shapes are read),
    compiled afresh: the persistent cache's key leaves out the ops' metadata, so a cached executable can carry the
    call stacks of older source, and the process keeps the executables it loaded (`jax.clear_caches`: the jitted
    functions load theirs again on their next call). The ops' names are those of the executable that ran (the
    same program)."""
    def shape(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
    with executables.fresh_compilation():
        jax.clear_caches()
        return fn.lower(*jax.tree.map(shape, args)).compile().as_text()


def trace_events(fn, n: int) -> tuple[list[dict], float]:
    """Runs fn() n times under the JAX profiler (Python tracer off): (the trace's events, wall seconds per call)."""
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, profiler_options=opts):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            wall = (time.perf_counter() - t0) / n
        events = json.loads(gzip.decompress(next(Path(d).rglob("*.trace.json.gz")).read_bytes()))
    return (events["traceEvents"] if isinstance(events, dict) else events), wall


def self_times(events: list[dict], module: str, n: int) -> collections.Counter:
    """Per XLA op of the executable `module` in a trace of n calls, its self time per call (ms): its spans minus
    the spans nested in them (a loop's or a conditional's span holds the ops of its body), so that a sum over ops
    counts every instant of the step once."""
    threads = collections.defaultdict(list)
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and a.get("hlo_module") == module and "hlo_op" in a:
            threads[e["pid"], e["tid"]].append(e)
    ms = collections.Counter()
    for spans in threads.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        nested = [0.0] * len(spans)
        open_ = []  # indices of the spans enclosing the current one, innermost last
        for i, e in enumerate(spans):
            while open_ and spans[open_[-1]]["ts"] + spans[open_[-1]]["dur"] <= e["ts"]:
                open_.pop()
            if open_:
                nested[open_[-1]] += e["dur"]
            open_.append(i)
        for e, inner in zip(spans, nested):
            ms[e["args"]["hlo_op"]] += (e["dur"] - inner) / 1e3 / n
    return ms


def _section(text: str, name: str) -> list[str]:
    m = re.search(r"^" + name + r"\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    return m.group(1).splitlines() if m else []


def _stacks(hlo_text: str) -> dict[int, list[str]]:
    """stack_frame_id -> the function names of its call stack, innermost first (the HLO text's StackFrames table;
    a parent_frame_id there is the parent's id + 1, 0 for none)."""
    fns = {int(line.split()[0]): line.split(" ", 1)[1].strip('"') for line in _section(hlo_text, "FunctionNames")}
    locs = {int(line.split()[0]): fns[int(re.search(r"function_name_id=(\d+)", line).group(1))]
            for line in _section(hlo_text, "FileLocations")}
    frames = {}
    for line in _section(hlo_text, "StackFrames"):
        d = dict(re.findall(r"(\w+)=(\d+)", line))
        frames[int(line.split()[0])] = (int(d["file_location_id"]), int(d["parent_frame_id"]) - 1)
    out = {}
    for fid in frames:
        chain, i = [], fid
        while i in frames and len(chain) < 200:
            loc, parent = frames[i]
            chain.append(locs[loc])
            if parent <= 0 or parent == i:
                break
            i = parent
        out[fid] = chain
    return out


def _part(chain: list[str]) -> str:
    if "Linear.__call__" in chain:
        return "projections"
    if PRODUCT_FUNCTION in chain:
        return "logits"
    for fn in chain:
        if fn in FUNCTION_PARTS:
            return FUNCTION_PARTS[fn]
    return "other"


def op_parts(hlo_text: str) -> tuple[dict[str, str], set[str]]:
    """HLO instruction name -> part of the model (from the call stack XLA's metadata keeps for it); and the names of
    the container ops (loops, conditionals, calls)."""
    stacks = _stacks(hlo_text)
    parts, containers, calls, where = {}, set(), {}, {}
    by_computation = collections.defaultdict(collections.Counter)  # computation -> parts of its ops
    inst = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z\-]+)\(")
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            computation = head.group(1)
            continue
        m = inst.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        if opcode in CONTAINERS:
            containers.add(name)
        sf = re.search(r"stack_frame_id=(\d+)", line)
        if sf:
            parts[name] = _part(stacks.get(int(sf.group(1)), []))
            by_computation[computation][parts[name]] += 1
        else:
            called = re.search(r"calls=%?([\w.\-]+)", line)
            calls[name], where[name] = (called.group(1) if called else None), computation

    def majority(computation):
        counts = by_computation.get(computation)
        return counts.most_common(1)[0][0] if counts else None

    # an op without metadata (a library fusion, ynn_fusion, may lose it): its fused body's part if that has any,
    # else the part most of its own computation's ops (a loop body) belong to
    for name, called in calls.items():
        parts[name] = majority(called) or majority(where[name]) or "other"
    return parts, containers


def part_times(op_ms: dict, parts: dict[str, str], missing: str = "other") -> collections.Counter:
    """Op times (`self_times`) summed by part (`op_parts`); an op the parts do not name counts as `missing`."""
    out = collections.Counter()
    for op, t in op_ms.items():
        out[parts.get(op, missing)] += t
    return out


def op_kind(hlo_op: str) -> str:
    """The kind of an XLA op from its HLO name (copy.12, dot.3, wrapped_convert.1, ynn_fusion, add_fusion.4...)."""
    s = hlo_op.lower()
    # "dot" first: a one-row product is a dot inside a loop fusion XLA names e.g. copy_dot_fusion
    for key, kind in (("dot", "dot"), ("ynn", "dot"), ("xnn", "dot"), ("copy", "copy"), ("convert", "convert"),
                      ("scatter", "scatter"), ("dynamic-update-slice", "scatter"), ("gather", "gather"),
                      ("sort", "sort"), ("while", "loop"), ("call", "loop"), ("fusion", "fusion")):
        if key in s:
            return kind
    return "other"


# ---- the transformers reference fixtures (torch) ------------------------------------------------------------------
def import_reference(script: str):
    """(torch, transformers), or an exit naming the reference extra that `script` needs."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"{script} needs the reference extra (torch, transformers): pip install -e '.[reference]' "
                         f"({e})") from None
    return torch, transformers


def reference_args(prog: str, doc: str, out: str) -> argparse.Namespace:
    """The reference scripts' command line (--out, --seed), with torch seeded and deterministic."""
    import torch

    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=out, help="folder for the checkpoint and reference.npz")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the random weights and prompt")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return args


def perturb(model, gen) -> None:
    """Redraws a transformers Qwen3.5 model's norm weights, `dt_bias` and conv weights from torch generator `gen`,
    so that every one of them matters (the fixtures' docstrings give the distributions)."""
    import torch

    def normal_(p, std: float, mean: float = 0.0) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float32))

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):
                normal_(p, 0.3, mean=1.0)  # plain-w gated norm
            elif name.endswith("layernorm.weight") or name.endswith("q_norm.weight") \
                    or name.endswith("k_norm.weight") or name == "model.norm.weight":
                normal_(p, 0.3)  # zero-centred, applied as (1 + w)
            elif name.endswith("dt_bias"):
                normal_(p, 0.5)
            elif name.endswith("conv1d.weight"):
                normal_(p, 0.5)


class ServerProcess:
    """`gdn-jax serve ARGS` in a subprocess on a free loopback port, unauthenticated (a caller's GDN_JAX_API_KEY,
    which `--api-key` would take, is left out); a context manager that waits for /health and stops it."""

    def __init__(self, args: list[str]):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "gdn_jax.entrypoints.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *args]
        env = {k: v for k, v in os.environ.items() if k != "GDN_JAX_API_KEY"}
        self.proc = subprocess.Popen(cmd, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import httpx

        for _ in range(2400):  # bounded: 20 minutes (start-up compiles every step shape)
            if self.proc.poll() is not None:  # a setting it refused: its one-line error is printed above
                raise ValueError(f"the server (gdn-jax serve) exited with status {self.proc.returncode} before it "
                                 f"was up: its error is above")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy in 20 minutes")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
