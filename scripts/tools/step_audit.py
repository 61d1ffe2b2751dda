"""What the engine's steps hold, lowered for a platform from abstract shapes: the conditionals, while loops, custom
calls and collectives of the decode, prefill and mixed steps, without a device of that platform.

    .venv/bin/python scripts/tools/step_audit.py --model qwen3.5-9b --platform cuda --out results/step_audit
    .venv/bin/python scripts/tools/step_audit.py --model tiny-random --platform cpu --compile --out results/audit
    .venv/bin/python scripts/tools/step_audit.py --model tiny-random --platform cpu --forms generic --compile --out DIR

Each step is traced from abstract weights and pools (nothing allocated) and lowered with `lowering_platforms`: a
StableHLO module as the platform's compiler would receive it. The forms are those the engine takes there: XLA's
generic ones off the CPU (`--unroll` as GDN_JAX_UNROLL_LAYERS sets it), this machine's resolved ones on the CPU
(`--forms generic`: the generic ones there too). A mixed step runs as its prefill and its decode sub-batch, two
executables (docs/design.md, "Mixed prefill and decode steps"): mixed.mlir holds both modules and its counts are
their sums.

Counted in the StableHLO text: `conditionals` (stablehlo.case and stablehlo.if: each is a branch index XLA's GPU
runtime reads back to the host), `while_loops` (stablehlo.while; XLA may fold a loop of known trip count, so the
compiled program can hold fewer), `custom_calls` and `collectives` (all_reduce, all_gather, reduce_scatter,
all_to_all, collective_permute). With `--compile` (the CPU only: this process's backend) also the compiled program's
copies of a whole pool, each a pool updated out of place.

Writes DIR/{decode,prefill,mixed}.mlir and DIR/step_audit.json, and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from gdn_jax.backends.cpu import tuning
from gdn_jax.config import PRESETS, EngineConfig, get_preset
from gdn_jax.entrypoints.cli import positive_int
from gdn_jax.model.forms import UNROLL_SETTINGS, Forms
from gdn_jax.model.weights import abstract_model
from gdn_jax.worker.memory import plan_memory
from gdn_jax.worker.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import environment, parse, run_command, write_json  # noqa: E402

COUNTS = {"conditionals": r"stablehlo\.(?:case|if)\b", "while_loops": r"stablehlo\.while\b",
          "custom_calls": r"stablehlo\.custom_call\b",
          "collectives": r"stablehlo\.(?:all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)\b"}


def counts(text: str) -> dict[str, int]:
    """The ops of `COUNTS` in a StableHLO module's text."""
    return {name: len(re.findall(pattern, text)) for name, pattern in COUNTS.items()}


def pool_copies(worker: Worker, shape: tuple[int, int, int]) -> int:
    """Copies of a whole pool in the compiled step of `shape` (this process's backend)."""
    hlo = worker.compiled_step(shape).as_text()
    pools = {x.size for x in jax.tree.leaves(worker.state)}
    sizes = [math.prod(int(d) for d in dims.split(",") if d)
             for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", hlo)]
    return sum(n in pools for n in sizes)


def audit_worker(a) -> Worker:
    """The engine's worker for `a`'s model and settings, on abstract weights and pools, in the platform's forms."""
    cfg = get_preset(a.model)
    dtype = getattr(jnp, a.dtype)
    settings = EngineConfig.create(dtype=a.dtype, max_num_seqs=a.rows, max_model_len=a.max_model_len,
                                   max_num_batched_tokens=max(a.tokens, 64))
    # the forms are given before the worker jits its steps with them
    engine_cpu = a.platform == "cpu" and a.forms == "engine"
    forms = (dataclasses.replace(tuning.resolve_forms(dtype), unroll=a.unroll) if engine_cpu else
             Forms(unroll=a.unroll, paged_decode="on" if a.paged_decode else "off"))
    graphdef, params = abstract_model(cfg, dtype)
    # (abstract pools: the budget only has to hold the settings' minimum, and their size changes no op)
    return Worker(cfg, graphdef, params, plan_memory(cfg, settings, 64 << 30), settings, forms=forms)


def lower(worker: Worker, shape: tuple[int, int, int], platform: str) -> str:
    return worker.traced_step(shape).lower(lowering_platforms=(platform,)).as_text()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="step_audit.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-9b", choices=sorted(PRESETS), help="preset (default: %(default)s)")
    ap.add_argument("--platform", default="cuda", choices=["cuda", "cpu"],
                    help="the platform the steps are lowered for (default: %(default)s)")
    ap.add_argument("--out", required=True, help="folder for the .mlir files and step_audit.json")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="(default: %(default)s)")
    ap.add_argument("--rows", type=positive_int, default=64, help="decode rows, the engine's max_num_seqs "
                    "(default: %(default)s)")
    ap.add_argument("--tokens", type=positive_int, default=512, help="tokens of the prefill row (default: "
                    "%(default)s)")
    ap.add_argument("--max-model-len", type=positive_int, default=4096, help="(default: %(default)s)")
    ap.add_argument("--unroll", default="0", choices=UNROLL_SETTINGS,
                    help="layers traced one by one: every step (1), one-token steps (decode), none (0; default)")
    ap.add_argument("--forms", default="engine", choices=["engine", "generic"],
                    help="the forms the engine takes on --platform (engine), or XLA's generic ones, those of every "
                         "platform but the CPU (generic: with --platform cpu --compile, the program a GPU gets, "
                         "compiled here) (default: %(default)s)")
    ap.add_argument("--paged-decode", action="store_true", help="one-token attention by the GPU's paged kernel "
                    "(GDN_JAX_PAGED_DECODE=1; --platform cuda): a custom call per attention layer in place of its "
                    "loop over key chunks")
    ap.add_argument("--compile", action="store_true", help="also compile each step (--platform cpu) and count its "
                    "copies of a whole pool")
    a = parse(ap, argv, files=("decode.mlir", "prefill.mlir", "mixed.mlir", "step_audit.json"))
    if a.compile and a.platform != "cpu":
        ap.error("--compile: this process compiles for its own backend, the CPU: use --platform cpu")
    if a.paged_decode and a.platform != "cuda":
        ap.error("--paged-decode: the kernel is the GPU's: use --platform cuda")
    worker = audit_worker(a)
    shapes = {"decode": [worker.step_shape(a.rows, 1, False)], "prefill": [worker.step_shape(1, a.tokens, True)]}
    shapes["mixed"] = [worker.step_shape(1, a.tokens, True), worker.step_shape(a.rows - 1 or 1, 1, False)]
    out, steps = Path(a.out), {}
    for kind, kind_shapes in shapes.items():
        texts = [lower(worker, shape, a.platform) for shape in kind_shapes]
        (out / f"{kind}.mlir").write_text("\n".join(f"// step shape (rows, tokens, blocks) {s}\n{t}"
                                                   for s, t in zip(kind_shapes, texts)))
        total = {name: sum(counts(t)[name] for t in texts) for name in COUNTS}
        if a.compile:
            total["pool_copies"] = sum(pool_copies(worker, s) for s in kind_shapes)
        steps[kind] = {"shapes": [list(s) for s in kind_shapes], **total}
    print(f"{a.model} lowered for {a.platform}, {a.dtype}, unroll {a.unroll}, {a.forms} forms"
          + ", the paged decode kernel" * a.paged_decode)
    names = list(steps["decode"])[1:]
    print(f"{'step':<9}" + "".join(f"{n:>14}" for n in names))
    for kind, row in steps.items():
        print(f"{kind:<9}" + "".join(f"{row[n]:>14}" for n in names))
    result = {"model": a.model, "platform": a.platform, "dtype": a.dtype, "unroll": a.unroll, "steps": steps,
              "forms_kind": a.forms,
              "forms": dataclasses.asdict(worker.forms), "environment": environment()}
    write_json(out, "step_audit.json", result)
    return result


if __name__ == "__main__":
    run_command(main)
