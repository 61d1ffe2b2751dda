"""What a linear-state restore costs inside a decode step, on GDN layers of Qwen3.5-9B's shape.

    .venv/bin/python scripts/bench/bench_restore.py [--rows 16] [--gdn-layers 2] [--hidden 1024] [--slots 64]
                                                    [--dtype float32]

One jitted decode step (forward of `--rows` rows, one token each, over `--gdn-layers` GDN layers with 9B's
recurrent state: 32 value heads of 128 x 128, a 2 MiB float32 SSM state per slot and layer; a small hidden size,
MLP and vocabulary),
compiled four ways and timed in turn (in a rotating order) on the same donated pools:

- `no restore`: the engine's step; every row continues its own state (restore_requested False);
- `compiled out`: the same step with the restore removed from the program: rows read their live slots directly
  (the cold-start flag, which a step needs without restores too, stays);
- `restore all`: the engine's step where every row restores a checkpoint (source slot -> live slot);
- `copy, then step`: the previous design, a separate copy of `src or live` into every live slot before the forward
  (`restore_linear_state_slots`), so a row that restores nothing copies its slot onto itself.

Prints min / median per variant and writes JSON. On a shared machine read the minimum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.entrypoints.cli import output_file, positive_int
from gdn_jax.config import LINEAR, ModelConfig
from gdn_jax.backends.cpu import tuning
from gdn_jax.model.forms import Forms
from gdn_jax.model.state import Batch, init_state
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import restore_linear_state_slots, restore_sources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for the shared helpers in common.py
from common import run_command  # noqa: E402


def gdn_9b_config(layers: int, hidden: int) -> ModelConfig:
    """GDN layers with Qwen3.5-9B's recurrent state (16 key / 32 value heads of 128: 2 MiB of float32 SSM state
    per slot and layer); hidden size, MLP and vocabulary small, so that the step is dominated by the state it reads
    and writes rather than by the projections."""
    return ModelConfig(name="gdn-9b-shaped", vocab_size=1024, hidden_size=hidden, intermediate_size=512,
                       layer_types=(LINEAR,) * layers, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128)


def make_step(graphdef, variant: str, forms: Forms):
    def step(params, state, batch_arrays, live, requested, src):
        if variant == "compiled out":  # cold starts stay (has_initial_state); no row reads another slot
            ids, warm = None, restore_sources(live, requested, src)[1]
        elif variant == "copy, then step":
            state, warm = restore_linear_state_slots(state, live, requested, src)
            ids = None
        else:
            ids, warm = restore_sources(live, requested, src)
        batch = Batch(*batch_arrays, linear_state_ids=live, has_initial_state=warm, initial_state_ids=ids)
        return forward(graphdef, params, batch, state, forms=forms)

    return jax.jit(step, donate_argnums=(1,))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=positive_int, default=16, help="decode rows per step (default: %(default)s)")
    ap.add_argument("--gdn-layers", type=positive_int, default=2, help="GDN layers of 9B's state shape (default: %(default)s)")
    ap.add_argument("--slots", type=positive_int, default=64, help="linear-state slots in the pools (default: %(default)s)")
    ap.add_argument("--hidden", type=positive_int, default=1024, help="hidden size (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter and activation dtype (default: %(default)s)")
    ap.add_argument("--repeats", type=positive_int, default=25, help="timed steps per variant (default: %(default)s)")
    ap.add_argument("--out", type=output_file, default="results/bench_restore.json",
                    help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.slots < 1 + 2 * args.rows:  # slot 0 is padding; each row has a live slot and a checkpoint source
        ap.error(f"--slots ({args.slots}) must be at least 1 + 2 x --rows ({args.rows}) = {1 + 2 * args.rows}")

    B, dtype = args.rows, jnp.dtype(args.dtype)
    cfg = gdn_9b_config(args.gdn_layers, args.hidden)
    graphdef, params = init_model(cfg, dtype=dtype)
    state = init_state(cfg, 2, 16, args.slots, dtype)
    slot_mb = sum(p[:, 0].nbytes for p in (state.conv, state.ssm)) / 2**20  # one slot of every layer
    rng = np.random.default_rng(0)
    batch_arrays = (rng.integers(4, cfg.vocab_size, (B, 1)).astype(np.int32), np.full(B, 100, np.int32),
                    np.ones(B, np.int32), np.zeros((B, 1), np.int32), np.zeros((B, 1), np.int32))
    live = np.arange(1, B + 1, dtype=np.int32)
    src = np.arange(B + 1, 2 * B + 1, dtype=np.int32)
    restoring = {"no restore": False, "compiled out": False, "restore all": True, "copy, then step": False}
    compiled, forms = {}, tuning.resolve_forms(dtype)  # the engine's forms
    for name, restore in restoring.items():
        ops = (live, np.full(B, restore), src if restore else np.full(B, -1, np.int32))
        compiled[name] = (make_step(graphdef, name, forms).lower(params, state, batch_arrays, *ops).compile(), ops)
    times = {name: [] for name in compiled}
    names = list(compiled)
    for r in range(args.repeats + 1):  # the first round warms up; the order rotates, so none always follows another
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, ops = compiled[name]
            t0 = time.perf_counter()
            logits, state = fn(params, state, batch_arrays, *ops)
            jax.block_until_ready(state)
            times[name].append(time.perf_counter() - t0)
    print(f"{B} rows x {args.gdn_layers} GDN layers (9B shapes, {args.dtype}), {args.slots} slots of "
          f"{slot_mb:.1f} MiB (per row: the SSM + conv state of every GDN layer)")
    rows = []
    for name, ts in times.items():
        ts = ts[1:]
        rows.append({"variant": name, "min_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts)})
        print(f"  {name:16s} min {rows[-1]['min_ms']:7.2f} ms   median {rows[-1]['median_ms']:7.2f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": B, "gdn_layers": args.gdn_layers, "slots": args.slots, "dtype": args.dtype,
                               "slot_mib": slot_mb, "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main)
