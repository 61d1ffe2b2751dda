"""Where a jitted step's time goes: XLA op times from a JAX profiler trace, each op's kind from its name and its
part of the model from the call stack XLA's metadata keeps for it. Shared by the profiling and benchmark scripts
(`bench_decode.py`, `profile_forward.py`, `bench_gpu.py`); not a command.

Parts (`op_parts`, the innermost function of an op's call stack that names one):

- `projections`: the layers' projection and MLP matmuls (`Linear.__call__` in gdn_jax/model.py);
- `gdn_rule`: the gated delta rule (gdn_jax/gated_delta.py: chunked, or the decode step's recurrent one);
- `conv`: the causal depthwise conv of the GDN layers (`causal_conv1d`);
- `gdn_state`: the GDN conv and SSM states read from and written to their pools (restores, checkpoint saves, and
  the decode step's loop that advances the states in place, bar its rule; with the compiled CPU kernel,
  `cpu_kernels`, that whole update, its rule included: one op);
- `attention`: the full-attention layers' scores, softmax and values, the KV cache writes and reads, RoPE;
- `norms_elementwise`: RMS norms, gates, activations, residual adds, the GDN input gates, dtype conversions;
- `logits`: the final norm and LM head;
- `other`: everything else (embedding gather, layer-loop bookkeeping).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax

from gdn_jax.worker import executable_store as executables


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


PARTS = ("projections", "gdn_rule", "conv", "gdn_state", "attention", "norms_elementwise", "logits", "other")
# innermost function of an op's call stack -> part (the first listed one met walking outwards); a projection matmul is
# any op under `Linear.__call__`, the LM head any other op under `_product` (and the rest of the head's product, such
# as the padding of a wide one-row product to two rows, under `Qwen35Model.logits`)
FUNCTION_PARTS = {
    "Qwen35Model.logits": "logits",
    "causal_conv1d": "conv",
    "l2norm": "norms_elementwise",
    "chunk_gated_delta_rule": "gdn_rule",
    "recurrent_gated_delta_rule": "gdn_rule",
    "token_step": "gdn_rule",
    "new_state": "gdn_rule",
    "decode_token": "gdn_rule",
    "gdn_prefill": "gdn_rule",  # the CPU kernel of prefill steps (cpu_kernels.gdn_prefill)
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
CONTAINERS = ("while", "conditional", "call")  # ops whose time is their bodies' ops


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
    if "_product" in chain:
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
