"""Smoke tests of the benchmark scripts: each `main` runs with its smallest flags on a tiny model and writes the JSON
its docstring describes, with one row per configuration and positive times. (No timing is asserted.)"""

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parent.parent


def _script(name):
    """The module of scripts/<folder>/<name>.py, or of scripts/common.py: imported from its folder as the command
    runs it (the script puts scripts/ on sys.path for `common` itself)."""
    (path,) = [p for p in (ROOT / "scripts").rglob(f"{name}.py")]
    sys.path.insert(0, str(path.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(path.parent))


@pytest.mark.slow  # ~55 s: two engines compile their prefill and decode steps
def test_bench_decode_reports_every_batch_and_dtype(tmp_path):
    out = tmp_path / "decode.json"
    # 32 tokens per step: the second row's 256-token prompt takes several steps, through which the first row decodes
    # (more tokens than the script once let a request generate: its timed steps then ran one row)
    _script("bench_decode").main(["--preset", "tiny-random", "--prompt", "256", "--batches", "1,2", "--dtypes",
                                  "float32,bfloat16", "--steps", "2", "--profile-steps", "1", "--chunk-stride", "16",
                                  "--max-num-batched-tokens", "32", "--max-num-seqs", "2", "--probe-mib", "4",
                                  "--peak", "float32=100", "--out", str(out), "--layers", "5", "--vocab-size", "300"])
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny-random" and result["prompt"] == 256
    # the bound reads at the fastest probe: the engine's own one-row product at either vector width among them
    bw = result["measured_bandwidth"]
    assert set(bw) == {"sum", "gemv", "rows_256", "rows_512", "best"} and bw["best"] == max(bw.values())
    assert result["bound_bandwidth_bytes_per_s"] == max(16e9, bw["best"])
    assert [(r["dtype"], r["batch"], r["layers"], r["vocab_size"]) for r in result["rows"]] == [
        ("float32", 1, 5, 300), ("float32", 2, 5, 300), ("bfloat16", 1, 5, 300), ("bfloat16", 2, 5, 300)]
    for r in result["rows"]:
        assert 0 < r["step_ms_min"] <= r["step_ms_median"]
        # host and python split the wrapped steps (timed apart from `step`: compare them with those)
        assert 0 < r["host_ms_min"] <= r["host_ms_median"] < r["wrapped_step_ms_median"]
        assert 0 < r["python_ms_median"] < r["host_ms_median"]  # the host's own work, without dispatch
        # the host's part of the unwrapped steps' critical path: some of each step, not all of it
        assert 0 < r["critical_host_ms_min"] <= r["critical_host_ms_median"] < r["step_ms_median"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["step_ms_median"] / 1e3))
        need = r["bytes_per_step"]
        assert need["total"] == need["weights"] + need["kv"] + need["linear_state"] and need["kv"] > 0
        assert r["bound_ms"] > 0 and r["x_bound"] > 0
        prof = r["profile"]
        assert prof["op_ms"] and all(v >= 0 for v in prof["op_ms"].values())
        # the parts split the same self times; every op of the step is in the compiled text that names them
        assert sum(prof["part_ms"].values()) == pytest.approx(sum(prof["op_ms"].values()))
        assert "unattributed" not in prof["part_ms"]
        assert all(prof["part_ms"].get(p, 0) > 0 for p in ("projections", "gdn_state", "attention", "logits"))
        # the decode rule's own ops, unless the compiled CPU kernel does the whole update (one op, in gdn_state)
        assert (prof["part_ms"].get("gdn_rule", 0) > 0) != result["cpu_kernels"]
        # the compute floor: the given float32 rate, a measured bfloat16 one
        assert r["matmul_flops_per_s"] == 1e11 if r["dtype"] == "float32" else r["matmul_flops_per_s"] > 0
        assert r["compute_ms"] == pytest.approx(1e3 * r["flops_per_step"] / r["matmul_flops_per_s"])
        assert r["x_compute"] == pytest.approx(r["step_ms_median"] / r["compute_ms"])
    one, two = result["rows"][:2]
    # the bound counts the context the rows hold: the first row of two decoded while the second prefilled
    assert 256 < one["context_tokens"] < two["context_tokens"] < 256 + 64
    # more rows read more KV and state, the same weights (bar the embedding rows), and do more arithmetic
    kv_per_token = [r["bytes_per_step"]["kv"] / (r["batch"] * r["context_tokens"]) for r in (one, two)]
    assert kv_per_token[0] == kv_per_token[1]
    assert two["flops_per_step"] > 2 * one["flops_per_step"]


def test_decode_flops_counts_every_matrix_once_per_row():
    """At no context a step's arithmetic is 2 x rows x the matrices' entries (the model's parameters less its 1-D
    ones, norms and gates, and less the embedding table, gathered and not multiplied, when it is not the LM head),
    plus the GDN rule's 4 products per state entry."""
    import jax
    from flax import nnx

    from gdn_jax import LLMEngine

    engine = LLMEngine("tiny-random", max_num_seqs=2, max_model_len=64, verbose=False)
    leaves = jax.tree.leaves(nnx.to_pure_dict(engine.worker.params))
    cfg = engine.cfg
    matrices = sum(x.size for x in leaves if x.ndim > 1)
    assert matrices == sum(x.size for x in leaves) - sum(x.size for x in leaves if x.ndim == 1)
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    want = 2 * 3 * (matrices - table) + 3 * 2 * 4 * len(cfg.linear_layer_ids) * state
    assert _script("bench_decode").decode_flops(engine, 3, 0) == want


@pytest.mark.parametrize("dtype, forms", [("float32", {"direct"}), ("bfloat16", {"direct", "upcast"})])
def test_matmul_peak_times_each_projection_shape_in_every_form_of_its_dtype(dtype, forms):
    """The peak is the FLOP-weighted rate of the projection shapes, each timed in the faster of its dtype's forms
    (a 16-bit product also with its operands converted to float32, what prefill does on CPU)."""
    import jax.numpy as jnp

    from gdn_jax.config import get_preset

    bench = _script("common")
    cfg = get_preset("tiny-random")
    peak = bench.matmul_peak(cfg, 8, jnp.dtype(dtype), repeats=1)
    shapes = peak["per_shape"]
    assert [(s["n_in"], s["n_out"], s["layers"]) for s in shapes] == list(bench.projection_shapes(cfg))
    assert {s["form"] for s in shapes} <= forms and all(s["s"] > 0 for s in shapes)
    flops = sum(2.0 * 8 * s["n_in"] * s["n_out"] * s["layers"] for s in shapes)
    assert peak["gflops"] == pytest.approx(flops / sum(s["s"] * s["layers"] for s in shapes) / 1e9)


def test_profile_forward_splits_the_op_time_by_part(tmp_path):
    out = tmp_path / "pf.json"
    result = _script("profile_forward").main(["--preset", "tiny-random", "--tokens", "32", "--dtypes", "float32",
                                              "--runs", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    r = result["float32"]
    assert sum(r["parts_ms"].values()) == pytest.approx(r["op_ms_total"])
    assert sum(r["parts_share"].values()) == pytest.approx(1.0)
    assert all(r["parts_ms"][p] > 0 for p in ("projections", "gdn_rule", "conv", "attention", "logits"))


def test_op_parts_attribute_the_attention_beyond_rope():
    """The attention part holds the attention's own ops (its loops over key chunks, or the one-query kernel's call),
    not only RoPE's: the layer loop calls `Attention.project_write` and `Attention.attend`, not `__call__` (whose ops
    alone counted as attention before, leaving the scores and softmax under "other")."""
    import jax.numpy as jnp
    import numpy as np

    from gdn_jax.backends.cpu import tuning
    from gdn_jax.config import get_preset
    from gdn_jax.model.qwen35 import init_model
    from gdn_jax.model.state import init_state

    common = _script("common")
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    batch, nb = common.one_row_batch(np.arange(64) % 100 + 2, 16)
    state = init_state(cfg, nb + 1, 16, 2)
    forward = common.forward_jit(64, tuning.resolve_forms(jnp.float32))  # the engine's forms, as profile_forward's
    text = forward.lower(graphdef, params, batch, state, False).compile().as_text()
    parts, _ = common.op_parts(text)
    attention = [name for name, part in parts.items() if part == "attention"]
    assert any(name.startswith(("while", "ffi_call", "custom-call")) for name in attention), attention


def test_self_times_subtract_nested_spans():
    profile = _script("common")

    def span(op, ts, dur, tid=1, module="jit_step"):
        return {"ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": {"hlo_op": op, "hlo_module": module}}

    # a loop [0, 100) holding a cond [10, 60) holding a dot [20, 50), then an add [70, 80); another thread's dot
    # overlaps in time but is not nested; ops of another module are left out; two calls traced (n = 2)
    events = [span("while", 0, 100), span("cond", 10, 50), span("dot", 20, 30), span("add", 70, 10),
              span("dot", 30, 40, tid=2), span("copy", 0, 500, module="jit_other"), {"ph": "M", "pid": 0}]
    ms = profile.self_times(events, "jit_step", 2)
    assert dict(ms) == pytest.approx({"while": 0.02, "cond": 0.01, "dot": 0.035, "add": 0.005})


def test_profile_step_splits_a_prefill_step_by_part(tmp_path):
    out = tmp_path / "step.json"
    _script("profile_step").main(["--preset", "tiny-random", "--tokens", "32", "--rows", "2", "--dtypes", "float32",
                                  "--steps", "2", "--runs", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert (result["tokens"], result["rows"]) == (32, 2)
    (r,) = result["results"]
    assert 0 < r["host_ms_median"] < r["wall_ms_median"]
    assert sum(r["parts_ms"].values()) == pytest.approx(r["op_ms_total"])
    assert sum(r["parts_share"].values()) == pytest.approx(1.0)
    assert all(r["parts_ms"][p] > 0 for p in ("projections", "gdn_rule", "gdn_state", "attention", "sampling"))


def test_bench_scheduler_reports_each_concurrency(tmp_path):
    out = tmp_path / "scheduler.json"
    _script("bench_scheduler").main(["--seqs", "2", "4", "--steps", "40", "--warmup", "10", "--prefix-len", "32",
                                     "--suffix-len", "8", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["num_seqs"] for r in result["results"]] == [2, 4]
    for r in result["results"]:
        assert r["decode"]["steps"] + r["prefill"]["steps"] == 40 and r["decode"]["steps"] > 0
        assert r["decode"]["p50_ms"] > 0 and 0 <= r["hit_rate"] <= 1


def test_bench_gdn_rule_times_each_form_checked_against_the_token_by_token_rule(tmp_path):
    from gdn_jax.backends.cpu import library

    out = tmp_path / "rule.json"
    result = _script("bench_gdn_rule").main(["--shapes", "2x40x4x16", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (row,) = result["results"]
    assert row["shape"] == [2, 40, 4, 16] and row["key_heads"] == 2  # half the value heads by default
    forms = row["forms"]
    assert set(forms) == ({"kernel", "fused", "parallel"} if library.available() else {"fused", "parallel"})
    for r in forms.values():
        assert 0 < r["min_ms"] <= r["median_ms"]
        assert r["max_abs_o_diff"] < 1e-5 and r["max_abs_state_diff"] < 1e-5
    if "kernel" in forms:
        assert forms["kernel"]["over_kernel"] == 1.0
        assert forms["fused"]["over_kernel"] == pytest.approx(forms["fused"]["min_ms"] / forms["kernel"]["min_ms"])


@pytest.mark.parametrize("argv, message", [(["--shapes", "2x40x4"], "ROWSxTOKENSxHEADSxDIM"),
                                           (["--forms", "kernel,chunked"], "forms are some of"),
                                           (["--shapes", "1x8x4x16", "--key-heads", "3"], "does not divide")])
def test_bench_gdn_rule_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        _script("bench_gdn_rule").main(argv + ["--out", "/dev/null"])
    assert message in capsys.readouterr().err


def test_bench_kernel_ceiling_checks_its_kernel_and_reports_both_products(tmp_path):
    """The peaks, then each rows count timed by the kernel and by the engine's product, then the GDN decode update in
    XLA's form and by the package's kernel (checked against XLA's); on a CPU without AVX-512 BF16 or a machine without
    a C compiler, a refusal that says which."""
    import shutil

    script = _script("bench_kernel_ceiling")
    out = tmp_path / "kernel.json"
    argv = ["--k", "256", "--n", "80", "--matrices", "2", "--rows", "1", "9", "16", "--repeats", "2",
            "--peak-iterations", "1000", "--gdn-rows", "1", "6", "--gdn-layers", "2", "--gdn-slots", "13",
            "--gdn-heads", "3", "--gdn-dim", "16", "--out", str(out)]
    if not script.cpu_has_avx512_bf16() or not (shutil.which("cc") or shutil.which("gcc")):
        with pytest.raises(SystemExit, match="AVX-512 BF16|no C compiler"):
            script.main(argv)
        return
    result = script.main(argv)
    assert json.loads(out.read_text()) == result
    assert all(v > 0 for v in result["peaks"].values())
    assert [(r["rows"], r["impl"]) for r in result["rows"]] == [(1, "kernel"), (1, "engine"), (9, "kernel"),
                                                                (9, "engine"), (16, "kernel"), (16, "engine")]
    for r in result["rows"]:
        assert 0 < r["ms_min"] <= r["ms_median"] and r["gflop_per_s"] > 0
        assert r["impl"] == "engine" or r["max_relative_error"] < 1e-4  # 9 rows: a partial tile; 80: overlapping blocks
    # the GDN update: checked against the engine's (a cold row, a restoring one, the others continuing their slots)
    gdn = result["gdn"]
    assert (gdn["layers"], gdn["slots"], gdn["heads"], gdn["dim"]) == (2, 13, 3, 16)
    from gdn_jax.backends.cpu import library  # the package's own kernel beside them where it builds

    impls = ["engine"] + ["package_kernel"] * library.available()
    assert [(r["gdn_rows"], r["impl"]) for r in gdn["rows"]] == [(n, i) for n in (1, 6) for i in impls]
    for r in gdn["rows"]:
        assert 0 < r["ms_min"] <= r["ms_median"] and r["state_gb_per_s"] > 0
        assert r["impl"] == "engine" or r["max_relative_error"] < 1e-5
    # a head dimension that is no multiple of 16 takes the kernel's plain loop: checked the same way
    odd = script.main(argv[:-2] + ["--rows", "1", "--gdn-rows", "6", "--gdn-dim", "8", "--out", str(out)])
    assert [r["max_relative_error"] < 1e-5 for r in odd["gdn"]["rows"]
            if r["impl"] == "package_kernel"] == [True] * library.available()
    with pytest.raises(SystemExit):
        script.main(argv[:-2] + ["--n", "40", "--out", str(out)])  # fewer than 3 blocks of 16 columns
    with pytest.raises(SystemExit):  # 2 x 6 rows need 13 slots (12 distinct slots + the padding one)
        script.main(argv[:-2] + ["--gdn-slots", "12", "--out", str(out)])


def test_bench_sampling_reports_each_cell(tmp_path):
    out = tmp_path / "sampling.json"
    _script("bench_sampling").main(["--vocab", "512", "--rows", "1", "2", "--width", "32", "--repeats", "2",
                                    "--out", str(out)])
    result = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["penalties"]) for r in result] == [(1, False), (1, True), (2, False), (2, True)]
    for r in result:  # each time named: the minimum and the median over the repeats, as the table shows them
        for t in (r["host_build_ms"], r["device_ms"]):
            assert set(t) == {"min", "median"} and 0 < t["min"] <= t["median"]
        assert (r["dense_host_counts_ms"] is not None) == r["penalties"]


@pytest.mark.slow
def test_bench_restore_reports_every_variant(tmp_path):
    out = tmp_path / "restore.json"
    _script("bench_restore").main(["--rows", "2", "--gdn-layers", "1", "--slots", "5", "--hidden", "64",
                                   "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["rows"] == 2 and result["slot_mib"] > 0
    assert [r["variant"] for r in result["results"]] == ["no restore", "compiled out", "restore all",
                                                          "copy, then step"]
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in result["results"])


@pytest.mark.slow
def test_bench_itl_reports_both_modes(tmp_path):
    out = tmp_path / "itl.json"
    _script("bench_itl").main(["--model", "tiny-random", "--decoders", "2", "--short", "8", "--prompt", "64",
                               "--lead", "2", "--max-tokens", "6", "--chunk-stride", "16",
                               "--max-num-batched-tokens", "32", "--max-model-len", "128", "--runs", "1",
                               "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"separate", "mixed"}
    for mode in result["modes"].values():
        (run,) = mode["runs"]
        assert 0 < run["p50_itl_ms"] <= run["max_itl_ms"] and run["long_ttft_ms"] > 0 and run["gaps"] > 0
        assert run["compilations"] == 0  # the first (untimed) pass compiled the shapes
    runs = {mode: r["runs"][0] for mode, r in result["modes"].items()}
    assert runs["mixed"]["mixed_steps"] > 0 and runs["separate"]["mixed_steps"] == 0


@pytest.mark.slow
def test_bench_serving_reports_server_and_offline_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("GDN_JAX_API_KEY", "a caller's key")  # the servers the script starts are its own, keyless
    out = tmp_path / "serving.json"
    _script("bench_serving").main(["--model", "tiny-random", "--concurrency", "1", "--requests", "2", "--system",
                                   "16", "--question", "4", "--max-tokens", "6", "--chunk-stride", "16",
                                   "--max-model-len", "32", "--out", str(out)])  # 20-token prompts + 6
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {f"{kind}, cache {c}" for kind in ("server", "offline") for c in ("on", "off")}
    for name, by_clients in result["rows"].items():
        r = by_clients["1"]
        assert r["requests"] == 2 and r["compilations_during_measurement"] == 0, name
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] and r["itl_p50_ms"] > 0 and r["output_tok_per_s"] > 0, name
        # the system prompt (one 16-token stride) warmed by the first pass is reused by every measured request
        assert r["cached_tokens_per_request"] == (16 if name.endswith("on") else 0), name
    assert set(result["overhead"]) == {"cache on, 1 clients", "cache off, 1 clients"}


def test_bench_tp_reports_each_size_split_over_host_devices(tmp_path):
    """Each size in a process of its own with 2 host devices: at TP=2 device 0 holds about half the weights and
    half the pools, and nothing compiles after the first request."""
    out = tmp_path / "tp.json"
    _script("bench_tp").main(["--model", "tiny-random", "--sizes", "1,2", "--prompt-len", "40", "--decode-tokens",
                              "3", "--repeats", "1", "--out", str(out)])
    one, two = json.loads(out.read_text())["steps"]
    assert (one["tp"], two["tp"]) == (1, 2)
    for r in (one, two):
        assert r["ttft_ms"] > 0 and r["decode_step_ms"] > 0 and r["compilations_after_first"] == 0
    assert 0.45 < two["weights_mib_device0"] / one["weights_mib_device0"] < 0.55
    assert two["pools_mib_device0"] * 2 == pytest.approx(one["pools_mib_device0"])


def test_bench_tp_loads_a_written_checkpoint_at_tp_1_and_4(tmp_path):
    out = tmp_path / "load.json"
    _script("bench_tp").main(["--load-rss", "--rss-preset", "tiny-random", "--rss-layers", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    one, four, gathered = result["load"]
    assert (one["tp"], four["tp"], gathered["tp"], gathered["gathered"]) == (1, 4, 4, True)
    assert gathered["weights_mib_device0"] == four["weights_mib_device0"]
    assert one["weights_mib_all"] == pytest.approx(result["checkpoint_mib"], rel=1e-3)  # bfloat16, as written
    assert four["weights_mib_device0"] < 0.3 * one["weights_mib_device0"]  # a quarter, and the norms whole
    assert all(r["peak_rss_mib"] >= r["peak_anon_mib"] > 0 for r in result["load"])


def test_bench_moe_times_both_layers_and_plans_every_split(tmp_path):
    out = tmp_path / "moe.json"
    _script("bench_moe").main(["--preset", "tiny-random-moe", "--rows", "1,24", "--repeats", "1", "--dtype",
                               "float32", "--out", str(out)])
    rows = json.loads(out.read_text())["layers"]
    assert [r["rows"] for r in rows] == [1, 24] and all(r["moe_min_ms"] > 0 and r["dense_min_ms"] > 0 for r in rows)
    _script("bench_moe").main(["--preset", "tiny-random-moe", "--plan", "--devices", "4", "--device-gib", "0.5",
                               "--out", str(out)])
    plan = {(r["tp"], r["ep"]): r for r in json.loads(out.read_text())["plan"]}
    assert set(plan) == {(1, 4), (2, 2), (4, 1)}
    # the experts split over ep: a quarter of them per device at ep=4, all at ep=1
    assert plan[(1, 4)]["experts_gib"] * 4 == pytest.approx(plan[(4, 1)]["experts_gib"])
    assert all(r["kv_blocks"] > 0 and r["linear_slots"] > 0 for r in plan.values())
    with pytest.raises(SystemExit):  # one device here: the split is refused before anything runs
        _script("bench_moe").main(["--preset", "tiny-random-moe", "--ep-sizes", "2", "--out", str(out)])


@pytest.mark.slow
def test_bench_flood_reports_both_phases_and_the_refusal_past_the_limit(tmp_path):
    """A flood of 2 prompts x n=16 (16 tokens each) behind a server of 4 sequences, 2 of one request at once: the
    small requests get their first token in both phases, the flood finishes every sequence, and a request of n's
    largest is refused with 429 past the limit."""
    out = tmp_path / "flood.json"
    _script("bench_flood").main(["--model", "tiny-random", "--prompts", "2", "--n", "16", "--warm-prompts", "1",
                                 "--flood-max-tokens", "16",
                                 "--rounds", "2", "--interval", "0.05", "--headroom", "8", "--max-num-seqs", "4",
                                 "--max-running-per-request", "2", "--max-model-len", "64", "--out", str(out)])
    result = json.loads(out.read_text())
    for phase in ("idle", "behind the flood"):
        assert result[phase]["requests"] == 2 and 0 < result[phase]["ttft_p50_ms"] <= result[phase]["ttft_max_ms"]
    assert result["flood"]["finished"] == 32 and result["flood"]["error"] is None
    assert result["past the waiting limit"]["status"] == 429 and result["past the waiting limit"]["retry_after"]


def test_bench_host_times_the_stubbed_decode_steps(tmp_path):
    out = tmp_path / "host.json"
    _script("bench_host").main(["--preset", "tiny-random", "--prompt", "40", "--batches", "1,3", "--steps", "20",
                                "--chunk-stride", "16", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["batch"], r["steps"]) for r in result["rows"]] == [(1, 20), (3, 20)]
    for r in result["rows"]:
        assert 0 < r["host_ms_min"] <= r["host_ms_median"] and r["first_tenth_ms_median"] > 0


def test_bench_host_stubs_every_step_executable():
    """Each step executable the worker may call for a decode step is a stub (a 16-row decode step has its own)."""
    import numpy as np

    from gdn_jax import LLMEngine

    bench = _script("bench_host")
    engine = LLMEngine("tiny-random", max_num_seqs=2, max_model_len=64, verbose=False)
    bench.stub_device(engine, np.random.default_rng(0))
    left = [kind for kind, fn in engine.worker.step_functions().items()
            if kind not in ("prompt", "fetch") and not isinstance(fn, bench.Stub)]  # prompt logprobs; the host's
    assert left == []


@pytest.mark.parametrize("whole", [False, True])
def test_bench_host_detokenises_with_a_tokenizer_json(tmp_path, whole):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the cache restores the state"] * 5,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "host.json"
    _script("bench_host").main(["--preset", "tiny-random", "--prompt", "40", "--batches", "2", "--steps", "10",
                                "--chunk-stride", "16", "--tokenizer", str(tmp_path / "tokenizer.json"),
                                *(["--whole-decode"] if whole else []), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["whole_decode"] is whole and result["tokenizer"].endswith("tokenizer.json")
    assert [(r["batch"], r["steps"]) for r in result["rows"]] == [(2, 10)]


def test_bench_vs_vllm_reports_each_figure_and_the_ratios(tmp_path):
    peer = tmp_path / "vllm.txt"
    peer.write_text('log line\nRESULT {"shared": 32, "suffix": 16, "apc_on": {"cold": 0.5, "hit": 0.25, "cached": [32]}}\n'
                    'RESULT {"decode_step_s_B1": 0.02, "decode_step_s_B16": 0.04}\n')
    out = tmp_path / "vs.json"
    result = _script("bench_vs_vllm").main(["--model", "tiny-random", "--shared", "64", "--suffix", "16", "--n", "1",
                                            "--decode-prompt", "16", "--vllm", str(peer), "--out", str(out),
                                            "--max-num-batched-tokens", "4096"])  # vLLM-CPU's budget
    assert json.loads(out.read_text()) == result
    ours = result["gdn_jax"]
    assert ours["max_num_batched_tokens"] == 4096
    assert ours["cached"] == [64]  # the hit rounds reused the whole prefix (the default chunk_stride, 64)
    assert all(ours[k] > 0 for k in ("cold_s", "hit_s", "decode_step_s_B1", "decode_step_s_B16",
                                     "decode_engine_step_s_B1", "decode_engine_step_s_B16"))
    assert result["vllm"] == {"shared": 32, "suffix": 16, "cold": 0.5, "hit": 0.25, "cached": [32],
                              "decode_step_s_B1": 0.02, "decode_step_s_B16": 0.04}
    cold = result["table"][0]
    assert cold["vllm_ms"] == 500 and cold["ratio"] == pytest.approx(cold["gdn_jax_ms"] / 500)
    inside = result["table"][-1]  # the engine's own step: no vLLM figure of that name
    assert inside["figure"].strip() == "engine step inside, batch 16" and inside["vllm_ms"] is None is inside["ratio"]
    assert inside["gdn_jax_ms"] == 1e3 * ours["decode_engine_step_s_B16"]


@pytest.mark.parametrize("script, argv, message", [
    ("bench_decode", ["--profile-steps", "-1"], "argument --profile-steps: -1 is below 0"),
    ("bench_decode", ["--batches", "1,,4"], "argument --batches: '' is not an integer"),
    ("bench_decode", ["--steps", "0"], "argument --steps: 0 is below 1"),
    ("profile_step", ["--dtypes", "bf16", "--preset", "tiny-random"], "argument --dtypes: 'bf16': expected"),
    ("profile_forward", ["--dtypes", "bf16", "--preset", "tiny-random"], "argument --dtypes: 'bf16': expected"),
    ("profile_forward", ["--preset", "tiny"], "argument --preset: invalid choice: 'tiny'"),
    ("bench_forward", ["--preset", "tiny"], "argument --preset: invalid choice: 'tiny'"),
    ("bench_restore", ["--dtype", "bf16"], "argument --dtype: invalid choice: 'bf16'"),
    ("bench_host", ["--batches", "0"], "argument --batches: 0 is below 1"),
    ("bench_itl", ["--lead", "20", "--max-tokens", "8"], "--lead (20) must be below --max-tokens (8)"),
    ("bench_itl", ["--model", "tiny-random", "--decoders", "2", "--short", "8", "--max-tokens", "6", "--lead", "2",
                   "--prompt", "8", "--max-model-len", "10", "--runs", "1", "--out", "/dev/null"],
     "--short (8) + --max-tokens (6) exceeds --max-model-len (10)"),
    ("bench_itl", ["--model", "tiny-random", "--decoders", "2", "--short", "8", "--max-tokens", "6", "--lead", "2",
                   "--prompt", "64", "--max-model-len", "32", "--runs", "1", "--out", "/dev/null"],
     "--prompt (64) exceeds --max-model-len (32)"),
    ("bench_serving", ["--concurrency", "2", "0"], "argument --concurrency: 0 is below 1"),
    ("bench_restore", ["--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("bench_restore", ["--rows", "4", "--slots", "8"], "--slots (8) must be at least 1 + 2 x --rows (4) = 9"),
    ("bench_scheduler", ["--seqs", "-2"], "argument --seqs: -2 is below 1"),
    ("bench_compile", ["--limit", "-1"], "argument --limit: -1 is below 0"),
    ("bench_compile", ["--chunk-stride", "24"], "--chunk-stride (24) must be a multiple of --block-size (16)"),
    ("bench_compile", ["--preset", "tiny-random", "--shapes", "1x1x8", "--limit", "2"], "give it or --shapes, not both"),
    ("bench_compile", ["--preset", "tiny-random", "--limit", "1", "--compile-threads", "2"],
     "--compile-threads applies to --warm-up"),
    # one shape would be the largest prefill shape alone: no decode shape to extrapolate the total from (it was NaN)
    ("bench_compile", ["--preset", "tiny-random", "--max-num-seqs", "1", "--max-model-len", "32", "--chunk-stride",
                       "16", "--max-num-batched-tokens", "16", "--limit", "1", "--out", "/dev/null"],
     "--limit 1: the largest prefill and the largest decode shape are always timed: give 2 or more"),
    ("bench_compile", ["--preset", "tiny-random", "--speculative-tokens", "2"], "--speculative-tokens applies to "
     "--warm-up"),
    ("bench_compile", ["--preset", "tiny-random", "--warm-up", "--shapes", "1x1x8"], "--warm-up times the whole grid: "
     "--shapes does not apply"),
    ("bench_compile", ["--preset", "tiny-random", "--shapes", "1x1", "--out", "/dev/null"],
     "--shapes: expected ROWSxTOKENSxBLOCKS,... (e.g. 16x64x256,1x1x8), got '1x1'"),
    ("bench_serving", ["--system", "200", "--max-model-len", "128"], "exceeds --max-model-len (128)"),
    # refused before the run, not raised without a word (the engine measured was not the one asked for)
    ("bench_decode", ["--batches", "1,4", "--max-num-seqs", "2"],
     "--max-num-seqs 2 is below the largest of --batches (4)"),
    # an --out that cannot be written ended the run with a traceback after its work (a 10-minute soak's)
    ("bench_decode", ["--out", "/"], "argument --out: / is a folder"),
    ("soak_cache", ["--out", "/proc/version"], "argument --out: /proc/version cannot be written"),
    ("soak_cache", ["--minutes", "nan"], "argument --minutes: 'nan' is not a positive finite number"),  # 0 rounds, passed
    ("soak_cache", ["--tolerance", "-1"], "argument --tolerance: '-1' is not a nonnegative finite number"),
    ("soak_cache", ["--seed", "-1"], "argument --seed: -1 is below 0"),
])
def test_a_bad_count_is_an_error_naming_it_before_anything_runs(script, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _script(script).main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_compile_options_runs_the_sets_asked_for_beside_xla_defaults(tmp_path, capsys):
    bench = _script("bench_compile_options")
    with pytest.raises(SystemExit):
        bench.main(["--sets", "LLVM IR emitters;bogus"])
    assert "unknown option sets ['bogus']" in capsys.readouterr().err
    out = tmp_path / "options.json"
    result = bench.main(["--preset", "tiny-random", "--dtypes", "float32", "--shapes", "1x1", "--repeats", "1",
                         "--sets", "LLVM IR emitters, 512-bit vectors", "--out", str(out)])
    assert [r["options"] for r in result["results"]] == ["xla defaults", "LLVM IR emitters, 512-bit vectors"]
    assert result["results"][0]["max_abs_diff"] == 0.0  # the reference itself
    assert result["results"][1]["max_abs_diff"] < 1e-3  # vectorised differently, the same step
    written = json.loads(out.read_text())
    assert written["option_sets"]["LLVM IR emitters, 512-bit vectors"]["xla_cpu_prefer_vector_width"] == 512
    assert set(written["option_sets"]) == {"xla defaults", "LLVM IR emitters, 512-bit vectors"}


class _ScriptedEngine:
    """A stand-in for `LLMEngine` under bench_itl's workload: the decoders' prompts prefill first, then every step
    decodes each running request and prefills the rest of the budget (mixed steps); a step takes 1 ms per token it
    runs on the clock bench_itl reads."""

    def __init__(self, clock, budget):
        import types

        self.cfg = types.SimpleNamespace(vocab_size=512)
        self.scheduler = types.SimpleNamespace(reset_prefix_cache=lambda: None)
        self.clock, self.budget, self.todo, self.last_step_info = clock, budget, {}, {}

    def cache_stats(self):
        return {"compilations": 0}

    def add_request(self, rid, prompt, sp):
        self.todo[rid] = [len(prompt), sp.max_tokens]  # prompt tokens left, output tokens left

    def has_unfinished_requests(self):
        return bool(self.todo)

    def step(self):
        import types

        decode = [rid for rid, (p, _) in self.todo.items() if p == 0]
        left, ran = self.budget - len(decode), []
        for rid, req in self.todo.items():
            if req[0] and left:
                n = min(req[0], left)
                req[0], left = req[0] - n, left - n
                ran.append((rid, n))
        tokens = len(decode) + sum(n for _, n in ran)
        self.clock[0] += 1e-3 * tokens
        self.last_step_info = {"is_prefill": bool(ran), "decode_rows": len(decode), "rows": len(decode) + len(ran),
                               "tokens": tokens}
        sampled = decode + [rid for rid, _ in ran if self.todo[rid][0] == 0]
        outs = []
        for rid in sampled:
            self.todo[rid][1] -= 1
            outs.append(types.SimpleNamespace(request_id=rid))
            if self.todo[rid][1] == 0:
                del self.todo[rid]
        return outs


def test_bench_itl_times_only_the_long_prompts_chunks(monkeypatch):
    """The long-chunk step time is that of the steps prefilling the long prompt: the decoders' own prompts (16
    tokens, half the 32-token budget) prefill in a step before it arrives, which is no chunk of it."""
    import types

    bench = _script("bench_itl")
    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    args = types.SimpleNamespace(decoders=2, short=8, prompt=64, lead=2, max_tokens=6, max_num_batched_tokens=32)
    run = bench.one_pass(_ScriptedEngine(clock, 32), args, __import__("numpy").random.default_rng(0))
    # 64 tokens beside 2 decode rows: chunks of 30, 30 and 4 tokens; the last is below half the budget
    assert run["mixed_step_ms"] == pytest.approx(32.0)
    assert run["prefill_step_ms"] is None  # the decoders' 16-token step (16 ms) came before the long prompt
    assert run["long_ttft_ms"] == pytest.approx(32 + 32 + 6)


def test_bench_decode_bound_and_floor_count_the_context_of_the_timed_steps(tmp_path):
    """One row of a 16-token prompt: its first decode step (which ends the prefill loop) feeds token 17, the two
    untimed steps 18 and 19, the three timed steps 20 to 22, so each of those attends over 20, 21 and 22 tokens (the
    fed token's included): a mean context of 21. The bytes and multiply-adds at that context, counted by hand from
    tiny-random's config."""
    from gdn_jax.config import get_preset

    out = tmp_path / "decode.json"
    _script("bench_decode").main(["--preset", "tiny-random", "--prompt", "16", "--batches", "1", "--dtypes", "float32",
                                  "--steps", "3", "--profile-steps", "0", "--chunk-stride", "16", "--max-num-seqs",
                                  "1", "--probe-mib", "1", "--peak", "float32=100", "--bandwidth", "10",
                                  "--out", str(out)])
    (r,) = json.loads(out.read_text())["rows"]
    assert r["context_tokens"] == 21
    c = get_preset("tiny-random")
    D, I, V, ctx = c.hidden_size, c.intermediate_size, c.vocab_size, 21
    n_lin, n_full = len(c.linear_layer_ids), len(c.full_layer_ids)
    hk, hv, dk, dv, K = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim, c.linear_conv_kernel_dim)
    conv_dim = 2 * hk * dk + hv * dv
    H, kvh, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    mlp = 3 * D * I
    gdn = conv_dim * K + (2 * hk * dk + 2 * hv * dv + 2 * hv) * D + hv * dv * D  # conv taps, in_proj, out_proj
    attn = (2 * H * hd + 2 * kvh * hd) * D + H * hd * D  # q (+ its gate), k, v; o
    head = V * D  # untied: the LM head; the embedding table is gathered, one row per decode row
    vectors = (2 * D * c.num_hidden_layers + D + n_lin * (2 * hv + dv) + n_full * 2 * hd)  # norms, A_log, dt_bias
    assert not c.tie_word_embeddings
    assert r["bytes_per_step"] == {
        "weights": 4 * (c.num_hidden_layers * mlp + n_lin * gdn + n_full * attn + head + vectors + D),
        "kv": 4 * 2 * n_full * ctx * kvh * hd,
        "linear_state": 2 * n_lin * 4 * ((K - 1) * conv_dim + hv * dk * dv),
        "total": r["bytes_per_step"]["weights"] + r["bytes_per_step"]["kv"] + r["bytes_per_step"]["linear_state"]}
    assert r["bound_ms"] == pytest.approx(1e3 * r["bytes_per_step"]["total"] / 10e9)
    # 2 FLOPs per multiply-add: the matrices, the scores and values over the context, the GDN rule's 4 per state entry
    assert r["flops_per_step"] == 2 * (c.num_hidden_layers * mlp + n_lin * gdn + n_full * attn + head
                                       + n_full * 2 * ctx * H * hd + n_lin * 4 * hv * dk * dv)


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "0"], "argument --bandwidth: 0 is not a positive rate"),
    (["--bandwidth", "-24"], "argument --bandwidth: -24 is not a positive rate"),
    (["--peak", "float32=-186"], "argument --peak: 'float32=-186': expected DTYPE=GFLOPS"),
    (["--peak", "float32=0"], "argument --peak: 'float32=0': expected DTYPE=GFLOPS"),
    (["--peak", "flaot32=186"], "--peak: flaot32 not among --dtypes (float32,bfloat16)"),
    (["--dtypes", "float32,float16"], "argument --dtypes: 'float16': expected float32 or bfloat16"),
    (["--preset", "tiny"], "argument --preset: invalid choice: 'tiny'"),
])
def test_bench_decode_refuses_a_setting_before_the_probe(argv, message, monkeypatch, capsys):
    """A rate of 0 was read as none given (the measured one used instead), a negative one gave a negative bound or
    floor, a rate for a dtype not run was never used; a dtype or preset the engine refuses was found after the
    probe, and a wrong second dtype after the whole run of the first: each is an error naming the flag before the
    probe runs."""
    bench = _script("bench_decode")

    def probe(*args, **kwargs):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(bench, "measure_read_bandwidth", probe)
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_compile_summarises_and_extrapolates_the_shapes_it_timed(tmp_path):
    """Two of the grid's three prefill shapes, one of its two decode shapes, the sampler of one of its two rows
    buckets: the median of two shapes is their mean, and the total adds the mean of each kind (and of the sampling
    shapes) for every shape of it not timed."""
    out = tmp_path / "compile.json"
    _script("bench_compile").main(["--preset", "tiny-random", "--dtype", "float32", "--max-num-seqs", "2",
                                   "--max-model-len", "64", "--chunk-stride", "16", "--max-num-batched-tokens", "32",
                                   "--shapes", "1x16x4,1x32x4,1x1x4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["grid"] == [[1, 1, 4], [1, 16, 4], [1, 32, 4], [2, 1, 4], [2, 16, 4]] and r["num_sampling_shapes"] == 2
    assert r["shapes"] == [[1, 16, 4], [1, 32, 4], [1, 1, 4]] and [s["rows"] for s in r["sampling"]] == [1]
    (a, b), (d,) = r["per_shape_s"][:2], r["per_shape_s"][2:]
    assert r["prefill_total_s"]["median"] == pytest.approx((a + b) / 2) == r["prefill_total_s"]["mean"]
    assert r["decode_total_s"]["median"] == d
    assert all(0 < row["lower_cpu_s"] < row["cpu_s"] for row in r["rows"] + r["sampling"])  # lowering is a part
    assert r["measured_total_s"] == pytest.approx(a + b + d + r["sampling_s"])
    assert r["total_extrapolated"] and r["total_s"] == pytest.approx(r["measured_total_s"] + (a + b) / 2 + d
                                                                     + r["sampling_s"])


def test_bench_compile_times_the_speculating_workers_warm_up(tmp_path):
    """--speculative-tokens: the warm-up of the worker with the MTP block, which compiles a prefill executable per
    prefill shape of the grid and a verify executable per rows bucket (with the store off: none loaded)."""
    out = tmp_path / "compile.json"
    _script("bench_compile").main(["--preset", "tiny-random", "--dtype", "float32", "--max-num-seqs", "2",
                                   "--max-model-len", "32", "--chunk-stride", "16", "--max-num-batched-tokens", "16",
                                   "--warm-up", "--speculative-tokens", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    prefill = sum(s[1] > 1 for s in r["grid"])
    assert r["speculative_tokens"] == 1 and r["num_spec_shapes"] == prefill + 2  # rows buckets 1 and 2
    assert r["warm_up_stats"] == {"loaded": 0, "compiled": r["num_spec_shapes"]} and r["total_s"] > 0

def test_bench_compile_times_a_shape_named_twice_twice_and_counts_it_once(tmp_path):
    """A repeated shape is lowered and compiled again (it was found in JAX's in-memory caches: 0 s), and the
    measured total counts it once, at the median of its times."""
    out = tmp_path / "compile.json"
    _script("bench_compile").main(["--preset", "tiny-random", "--dtype", "float32", "--max-num-seqs", "1",
                                   "--max-model-len", "32", "--chunk-stride", "16", "--max-num-batched-tokens", "16",
                                   "--shapes", "1x1x2,1x1x2,1x1x2", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["shapes"] == [[1, 1, 2]] * 3
    assert all(row["lower_s"] > 0.01 and row["compile_s"] > 0.01 for row in r["rows"])
    times = sorted(r["per_shape_s"])
    assert r["measured_total_s"] == pytest.approx(times[1] + r["sampling_s"])


def test_bench_compile_makes_the_cpus_one_time_choices_before_the_first_shape(tmp_path, monkeypatch):
    """The kernels' build and the products' measured forms (`tuning.resolve_forms` of the model's dtype) are made
    first, before the worker and any shape is timed (with the cache off they are made in every process, and they
    landed in the first shape that needed them)."""
    import jax.numpy as jnp

    from gdn_jax.backends.cpu import tuning
    from gdn_jax.worker.worker import Worker

    events = []
    resolve = tuning.resolve_forms
    monkeypatch.setattr(tuning, "resolve_forms",
                        lambda dtype: events.append(("choices", jnp.dtype(dtype).name)) or resolve(dtype))
    lowered_step = Worker.lowered_step
    monkeypatch.setattr(Worker, "lowered_step", lambda self, shape: events.append("lower") or lowered_step(self, shape))
    for dtype in ("bfloat16", "float32"):
        events.clear()
        out = tmp_path / f"compile_{dtype}.json"
        _script("bench_compile").main(["--preset", "tiny-random", "--dtype", dtype, "--max-num-seqs", "1",
                                       "--max-model-len", "32", "--chunk-stride", "16", "--max-num-batched-tokens",
                                       "16", "--shapes", "1x1x2,1x16x2", "--out", str(out)])
        assert events[0] == ("choices", dtype) and events[-2:] == ["lower", "lower"]
        assert set(events[:-2]) == {("choices", dtype)}
        assert json.loads(out.read_text())["choices_s"] >= 0


def test_bench_compile_of_prefill_shapes_alone_gives_no_total_rather_than_nan(tmp_path, capsys):
    """With no decode shape timed there is no mean to extrapolate the grid's decode shapes from: the total is left
    out (null, and a printed line naming the missing kind); it was NaN, printed as "total nan s"."""
    out = tmp_path / "compile.json"
    _script("bench_compile").main(["--preset", "tiny-random", "--dtype", "float32", "--max-num-seqs", "1",
                                   "--max-model-len", "32", "--chunk-stride", "16", "--max-num-batched-tokens", "16",
                                   "--shapes", "1x16x2", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["shapes"] == [[1, 16, 2]] and r["decode_total_s"] is None and r["total_s"] is None
    assert r["measured_total_s"] == pytest.approx(r["per_shape_s"][0] + r["sampling_s"])
    printed = capsys.readouterr().out
    assert "nan" not in printed.lower() and "no total: no decode shape timed" in printed


def test_bench_itl_writes_the_long_chunk_step_its_table_prints(tmp_path, monkeypatch, capsys):
    import types

    import gdn_jax

    bench = _script("bench_itl")
    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(gdn_jax, "LLMEngine", lambda *args, **kwargs: _ScriptedEngine(clock, 32))
    out = tmp_path / "itl.json"
    bench.main(["--decoders", "2", "--short", "8", "--prompt", "64", "--lead", "2", "--max-tokens", "6",
                "--max-num-batched-tokens", "32", "--modes", "mixed", "--runs", "2", "--out", str(out)])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("mixed |")]
    mode = json.loads(out.read_text())["modes"]["mixed"]
    assert mode["long_chunk_step_ms_median"] == pytest.approx(32.0)  # two 30-token chunks beside 2 decode rows
    assert row.split("|")[-2].strip() == "32.0"


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").rglob("*.py")), ids=lambda p: p.name)
def test_a_script_imports_no_other_script_and_no_private_name_of_the_package(path):
    """What scripts share lives in scripts/common.py, the one module a script imports from scripts/; what a script
    needs of the package goes through its public names (`bench_decode`, `bench_forward` and `bench_gpu` imported each
    other in a circle, and scripts reached `worker._fn` or `engine._requests`)."""
    import ast

    scripts = {p.stem for p in (ROOT / "scripts").rglob("*.py")} - {"common"}
    tree = ast.parse(path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m.split(".")[0] for m in imported} & scripts, f"{path.name} imports another script"
    private = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and (n.module or "").split(".")[0] in ("gdn_jax", "scheduler") for a in n.names if a.name.startswith("_")]
    # transformers' config attribute is the one private attribute a script sets (the reference scripts)
    private += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__") and n.attr != "_attn_implementation"]
    assert not private, f"{path.name} reaches private names: {private}"


def test_bench_host_runs_as_a_command(tmp_path, monkeypatch):
    import runpy

    out = tmp_path / "host.json"
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    monkeypatch.setattr(sys, "argv", ["bench_host.py", "--preset", "tiny-random", "--prompt", "16", "--batches", "1",
                                      "--steps", "5", "--chunk-stride", "16", "--out", str(out)])
    runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_host.py"), run_name="__main__")
    assert [r["steps"] for r in json.loads(out.read_text())["rows"]] == [5]


def test_forward_flops_counts_the_models_own_matrices():
    """bench_forward's matmul work for tiny-random at 100 tokens, counted from the model's parameters: every
    projection matrix once per token, but the last layer's output projection and MLP once (only the last position's
    logits are computed), as the LM head; for attention, the causal triangle summed position by position, and one
    query in the last layer (a full-attention one in tiny-random). A GDN layer last runs its mixer (output projection
    included) at every position, its MLP once."""
    import jax
    from flax import nnx

    from gdn_jax.config import FULL, LINEAR, get_preset
    from gdn_jax.model.qwen35 import init_model

    cfg, T = get_preset("tiny-random"), 100
    assert cfg.layer_types[-1] == FULL
    work = _script("common").forward_flops(cfg, T)
    pure = nnx.to_pure_dict(init_model(cfg)[1])

    def kernels(tree):
        return sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
                   if jax.tree_util.keystr(path).endswith("['kernel']"))

    last = pure["layers"][len(cfg.layer_types) - 1]
    once = kernels(last["mlp"]) + last["self_attn"]["o_proj"]["kernel"].size
    assert work["dense"] == 2 * T * (kernels(pure["layers"]) - once) + 2 * once + 2 * pure["lm_head"]["kernel"].size
    scores_and_values = 2 * cfg.num_attention_heads * cfg.head_dim  # multiply-adds per query and key position
    triangle = sum(scores_and_values * (t + 1) for t in range(T))
    assert work["attention"] == 2 * (len(cfg.full_layer_ids) - 1) * triangle + 2 * scores_and_values * T

    gdn_last = dataclasses.replace(cfg, layer_types=(LINEAR, FULL, LINEAR, LINEAR))  # its mixer runs whole
    work = _script("common").forward_flops(gdn_last, T)
    pure = nnx.to_pure_dict(init_model(gdn_last)[1])
    once = kernels(pure["layers"][3]["mlp"])
    assert work["dense"] == 2 * T * (kernels(pure["layers"]) - once) + 2 * once + 2 * pure["lm_head"]["kernel"].size
    assert work["attention"] == 2 * triangle


def test_bench_compile_without_a_cache_uses_none_the_environment_names(tmp_path):
    """`--cache-dir off` (the default) compiles every shape afresh: a JAX_COMPILATION_CACHE_DIR in the environment
    turned JAX's persistent cache (and the executable store beside it) on under it, so a second run read its shapes
    from there."""
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_compile.py"), "--preset", "tiny-random",
                    "--dtype", "float32", "--max-num-seqs", "1", "--max-model-len", "32", "--chunk-stride", "16",
                    "--max-num-batched-tokens", "16", "--shapes", "1x1x2", "--out", str(tmp_path / "c.json")],
                   env=env, check=True, capture_output=True)
    assert json.loads((tmp_path / "c.json").read_text())["shapes"] == [[1, 1, 2]]
    assert not cache.exists()  # neither JAX's cache nor the executable store beside it


def test_profile_step_refuses_a_step_larger_than_the_budget_before_compiling(monkeypatch, tmp_path):
    """2 x 1500 tokens do not fit the engine's 2048-token budget: the first step prefilled one row, after its
    compilation, and the script ended in a traceback advising a budget it has no flag for."""
    bench = _script("profile_step")
    monkeypatch.setattr(bench.BlockTimer, "__call__", lambda *a: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match=r"--rows \(2\) x --tokens \(1500\) exceeds the 2048 tokens"):
        bench.main(["--preset", "tiny-random", "--tokens", "1500", "--rows", "2", "--dtypes", "float32",
                    "--out", str(tmp_path / "step.json")])


def test_bench_forward_times_compilation_apart_from_the_first_run(monkeypatch):
    """Every run of the forward moves a clock by 100 s and nothing else does: lowering and compilation take no time on
    it, the first run and each timed forward 100 s (the compile column held the first run as well)."""
    import types

    import jax
    import jax.numpy as jnp

    from gdn_jax.config import get_preset

    bench, common = _script("bench_forward"), _script("common")
    clock = [0.0]

    def advance():
        clock[0] += 100.0

    def forward(*args, **kwargs):
        jax.debug.callback(advance)
        return forward_real(*args, **kwargs)

    forward_real = common.forward  # the forward `common.forward_jit` jits
    monkeypatch.setattr(common, "forward", forward)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    setup, times, *_ = bench.time_jax(get_preset("tiny-random"), list(range(4, 20)), jnp.float32, 2)
    assert setup == {"lower_s": 0.0, "compile_s": 0.0, "first_run_s": 100.0} and times == [100.0, 100.0]


def test_bench_forward_says_how_far_any_float32_forward_could_beat_transformers(tmp_path, monkeypatch, capsys):
    """With transformers, the float32 floor is the forward's matmul work at the measured float32 peak, and no float32
    forward on the machine beats transformers by more than transformers' time over it (clocks and rates fixed)."""
    import jax.numpy as jnp
    import numpy as np

    bench = _script("bench_forward")
    logits = np.zeros(4, np.float32)
    monkeypatch.setattr(bench, "matmul_peak", lambda cfg, tokens, dtype: {
        "gflops": 50.0 if jnp.dtype(dtype) == jnp.float32 else 100.0, "per_shape": []})
    monkeypatch.setattr(bench, "time_jax", lambda cfg, tokens, dtype, repeats: (
        {"lower_s": 1.0, "compile_s": 1.0, "first_run_s": 2.0}, [3.0, 2.5], None, None, logits))
    monkeypatch.setattr(bench, "time_transformers", lambda cfg, tokens, params, repeats: ([4.0, 4.5], logits, 2))
    out = tmp_path / "forward.json"
    bench.main(["--preset", "tiny-random", "--tokens", "64", "--repeats", "2", "--out", str(out)])
    r = json.loads(out.read_text())
    floor = r["matmul_gflop"]["total"] / 50.0
    assert r["transformers_float32"]["float32_floor_s"] == pytest.approx(floor)
    assert r["transformers_float32"]["most_vs_transformers"] == pytest.approx(4.0 / floor)
    assert f"by more than {4.0 / floor:.2f}x" in capsys.readouterr().out


def test_bench_decode_times_its_steps_unwrapped(tmp_path, monkeypatch):
    """The reported step is the engine's own: the wrappers that split it into host and device time wait for the
    step's device work before sampling is dispatched, which the engine overlaps. Every wrapped call moves the
    script's clock by 1000 s: a timed step that went through a wrapper reads above it."""
    import time
    import types

    bench = _script("bench_decode")
    offset = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    wrapped = bench.BlockTimer.__call__

    def call(self, *args):
        offset[0] += 1000.0
        return wrapped(self, *args)

    monkeypatch.setattr(bench.BlockTimer, "__call__", call)
    out = tmp_path / "decode.json"
    bench.main(["--preset", "tiny-random", "--prompt", "16", "--batches", "1", "--dtypes", "float32", "--steps", "3",
                "--profile-steps", "0", "--chunk-stride", "16", "--max-num-seqs", "1", "--probe-mib", "1",
                "--peak", "float32=100", "--bandwidth", "10", "--out", str(out)])
    (r,) = json.loads(out.read_text())["rows"]
    assert 0 < r["step_ms_min"] <= r["step_ms_median"] < 1e5
    assert r["context_tokens"] == 21  # the plain steps are the timed ones, the wrapped ones follow them
    assert r["host_ms_median"] > 1e6  # the split comes from the wrapped steps


@pytest.mark.parametrize("steps, profiled", [(125, 3), (128, 0)])
def test_bench_decode_checks_that_the_profiled_and_the_last_steps_run_the_whole_batch(steps, profiled, tmp_path):
    """A row of a 16-token prompt may generate 256 tokens: the first (prefill), the step ending the prefill loop, 2
    untimed steps and 125 timed steps twice (plain, then wrapped) leave it 2, so the third profiled step would run no
    row: an error as in the timed steps (the profile traced fewer rows than the batch without a word). A step that
    runs no row at all leaves the engine's last_step_info as it was: the check read the step before's (128 timed
    steps: the last wrapped steps ran no row, unseen)."""
    bench = _script("bench_decode")
    with pytest.raises(SystemExit, match="batch 1: a decode step ran 0 rows"):
        bench.main(["--preset", "tiny-random", "--prompt", "16", "--batches", "1", "--dtypes", "float32", "--steps",
                    str(steps), "--profile-steps", str(profiled), "--chunk-stride", "16", "--max-num-seqs", "1",
                    "--probe-mib", "1", "--peak", "float32=100", "--bandwidth", "10",
                    "--out", str(tmp_path / "decode.json")])


@pytest.mark.slow  # ~25 s: the tiny model's training step compiles in both compute dtypes
def test_bench_train_times_compilation_apart_from_the_first_step(tmp_path):
    """Per compute dtype: compilation alone (`compile_s`), the first step apart from it (`first_step_s`), then the
    timed steps, at a smaller batch than the training run's; the JSON holds what the table prints. compile_s held
    the first step too."""
    out = tmp_path / "train.json"
    rows = _script("bench_train").main(["--repeats", "1", "--batch", "2", "--seq-len", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [r["compute_dtype"] for r in rows] == ["float32", "bfloat16"]
    assert {(r["batch"], r["seq_len"]) for r in rows} == {(2, 64)}
    for r in rows:
        assert r["compile_s"] > 0 and r["first_step_s"] > 0 and 0 < r["step_s_min"] <= r["step_s_median"]
        assert r["tokens_per_s_best"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s_min"])


GPU_CHECK_BENCH = ("--preset tiny-random --dtype float32 --prefill-tokens 128 --decode-batch 2 --decode-prompt 32 "
                   "--decode-steps 2 --shared 128 --new 32 --chunk-stride 32 --rounds 1 --pool-gib 0.1 "
                   "--matmul-probe 256")


def _gpu_check(out, tests, bench_args, compile_shapes=0, variants=""):
    """scripts/bench/gpu_check.sh on the CPU with `tests` (GPU_CHECK_TESTS), `bench_args` (BENCH_ARGS), the compile stage
    on `compile_shapes` shapes of tiny-random (COMPILE_SHAPES; 0 skips it) and `variants` (VARIANTS) of its decode."""
    env = {k: v for k, v in os.environ.items() if k != "GDN_JAX_TEST_COMPILE_CACHE"}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHON": sys.executable, "GPU_CHECK_TESTS": tests, "BENCH_ARGS": bench_args,
            "COMPILE_SHAPES": str(compile_shapes), "COMPILE_ARGS": "--preset tiny-random --dtype float32",
            "VARIANTS": variants, "VARIANT_ARGS": GPU_CHECK_BENCH + " --skip forward,ttft,off"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "bench" / "gpu_check.sh"), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~60 s: a pytest process, bench_gpu.py (three times) and bench_compile.py, each compiling
def test_gpu_check_runs_the_tests_then_every_stage_of_bench_gpu(tmp_path):
    """On the CPU the GPU session script runs end to end: the environment report, the tests it is given (their JUnit
    XML), bench_gpu.py with every stage and its traces, each figure in its JSON, the compile times of two step
    shapes, then the decode stage under each of two settings (one that XLA refuses: reported, not fatal)."""
    out = tmp_path / "gpu"
    run = _gpu_check(out, "tests/gdn_jax/test_restore.py::test_two_rows_may_restore_from_the_same_checkpoint",
                     GPU_CHECK_BENCH + " --profile", compile_shapes=2,
                     variants="GDN_JAX_UNROLL_LAYERS=1;XLA_FLAGS=--xla_no_such_flag=1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "backend cpu" in (out / "env.txt").read_text() and "gdn_jax imports" in (out / "env.txt").read_text()
    suite = (out / "tests.xml").read_text()
    assert 'tests="1"' in suite and 'failures="0"' in suite and 'errors="0"' in suite
    bench = json.loads((out / "bench_gpu.json").read_text())
    assert bench["forward"]["best_s"] > 0 and bench["decode"]["median_ms"] > 0 and bench["forward"]["finite"]
    assert bench["ttft"]["hit_ttft_ms_median"] > 0 and bench["off"]["off_ttft_ms_median"] > 0
    assert set(bench["ttft"]["hit_cached"]) == {128}  # every hit reused the whole shared part
    assert bench["decode"]["hlo"]["pool_copies"] == 0 and bench["decode"]["hlo"]["while_loops"] > 0  # in place
    assert bench["decode"]["hlo"]["conditionals"] > 0  # the layer loop's switches over the layers' matrices
    for stage in ("forward", "decode"):  # --profile: the traced calls' op time, of which some ran at once or nested
        (host,) = bench[stage]["profile"]["by_process"].values()
        assert 0 < host["busy_ms"] <= host["op_ms_total"] and bench[stage]["profile"]["wall_ms"] > 0
    compiled = json.loads((out / "bench_compile.json").read_text())
    assert compiled["preset"] == "tiny-random" and len(compiled["shapes"]) == 2
    assert all(t > 0 for t in compiled["per_shape_s"]) and compiled["num_shapes"] >= 2
    unrolled, bad_flag = json.loads((out / "variants.json").read_text())  # the variants, in their order
    assert unrolled["env"] == "GDN_JAX_UNROLL_LAYERS=1" and unrolled["exit"] == 0
    assert unrolled["result"]["unroll_layers"] and unrolled["result"]["decode"]["median_ms"] > 0
    assert "forward" not in unrolled["result"] and not bench["unroll_layers"]
    assert unrolled["result"]["decode"]["hlo"]["conditionals"] == 0  # every layer's matrices known when traced
    assert bad_flag["exit"] != 0 and bad_flag["result"] is None and "xla_no_such_flag" in bad_flag["log_tail"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("variant")) == ["variants.json"]
    assert "tests exit 0, bench_gpu exit 0, bench_compile exit 0, variants exit 0 1" in run.stdout


def test_bench_gpu_busy_time_counts_nested_and_overlapping_spans_once():
    """busy_ms is the length of the spans' union (us in, ms out): a span inside another, and two that overlap, count
    once; a gap between them does not count."""
    busy = _script("bench_gpu").busy_ms
    assert busy([(20, 5), (0, 10), (2, 3), (22, 10), (40, 1)]) == pytest.approx((10 + 12 + 1) / 1e3)
    assert busy([(5, 0), (5, 2)]) == pytest.approx(2e-3) and busy([]) == 0


def test_gpu_check_runs_bench_gpu_after_failing_tests_and_reports_the_failure(tmp_path):
    """A failing test stage leaves the bench its turn, and the script's exit status says the tests failed."""
    out = tmp_path / "gpu"
    missing = "tests/gdn_jax/test_no_such_file.py"
    run = _gpu_check(out, missing, GPU_CHECK_BENCH + " --skip forward,ttft,decode,off")
    assert run.returncode != 0
    assert missing in (out / "tests.log").read_text()
    assert "tests exit 4, bench_gpu exit 0, bench_compile exit 0" in run.stdout  # 4: pytest's usage error
    assert not (out / "bench_compile.json").exists()  # COMPILE_SHAPES=0: no compile stage
    assert json.loads((out / "bench_gpu.json").read_text())["probes"]


@pytest.mark.slow  # ~30 s: two rounds, each a cache-on engine and the cache-off reference compiling their steps
def test_soak_cache_finds_the_exact_cache_exact_and_catches_an_unsafe_reuse(tmp_path):
    """One round of the soak (seed 2: a geometry whose workload hits the cache and restores checkpoints) with the
    exact cache: every request equals itself run alone without the cache. The same round with the ablation's unsafe
    reuse (a cold GDN state after a KV match): the soak reports the requests it changed, and the JSON holds them."""
    soak = _script("soak_cache")
    argv = ["--rounds", "1", "--requests", "6", "--seed", "2"]
    exact = soak.main(argv + ["--out", str(tmp_path / "exact.json")])
    assert exact["mismatches"] == [] and exact["totals"]["rounds"] == 1 and exact["totals"]["requests"] >= 5
    assert exact["totals"]["hits"] > 0 and exact["totals"]["checkpoints_restored"] > 0
    unsafe = soak.main(argv + ["--unsafe-reuse", "cold", "--out", str(tmp_path / "unsafe.json")])
    assert unsafe["mismatches"] and all(m["differences"] and m["seed"] == 2 for m in unsafe["mismatches"])
    assert json.loads((tmp_path / "unsafe.json").read_text())["mismatches"] == unsafe["mismatches"]


def test_bench_deterministic_times_both_modes_and_batch_variance_finds_no_difference_in_deterministic_mode(tmp_path):
    out = tmp_path / "det.json"
    _script("bench_deterministic").main(["--preset", "tiny-random", "--dtypes", "float32", "--prefill", "64",
                                         "--rows", "2", "--repeats", "1", "--steps", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["measure"] for r in rows] == ["prefill", "decode 2"]
    assert all(r[m]["min_ms"] > 0 for r in rows for m in ("default", "deterministic")) and rows[0]["ratio"] > 0
    out = tmp_path / "variance.json"
    _script("batch_variance").main(["--preset", "tiny-random", "--prompt", "40", "--hit", "32", "--others", "2",
                                    "--chunk-stride", "32", "--variants", "deterministic,gdn", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert results["deterministic"]["batched"] == {"max_abs_logprob": 0.0, "first_token_differs": None}
    assert results["deterministic"]["hit"]["max_abs_logprob"] == 0.0 and results["deterministic"]["cached"] == 32
    assert results["gdn"]["cached"] == 32


def test_step_audit_keeps_the_op_counts_of_tiny_randoms_steps(tmp_path, capsys):
    """The steps of tiny-random lowered for cuda from abstract shapes (no GPU): the layer loops' switches are its
    conditionals, none once the layers are unrolled; its while loops are the layer loops and, unrolled, the key chunks
    of its one attention layer (decode) and the chunked rule's and the attention's (prefill): no loop of one turn
    over the rows; the GPU's paged decode kernel leaves none in a decode step; a mixed step counts its two
    executables. On the CPU, compiled in the engine's forms and in the generic ones (the GPU's): no step copies a
    pool. --compile for cuda and --paged-decode for the CPU are refused."""
    audit = _script("step_audit")
    common = ["--model", "tiny-random", "--rows", "4", "--tokens", "64", "--max-model-len", "256"]
    ops = ("conditionals", "while_loops", "custom_calls", "collectives")

    def run(*argv):
        return {k: tuple(s[n] for n in ops) for k, s in audit.main([*common, *argv])["steps"].items()}

    assert run("--platform", "cuda", "--out", str(tmp_path / "loop")) == {
        "decode": (5, 2, 0, 0), "prefill": (5, 3, 0, 0), "mixed": (10, 5, 0, 0)}
    assert run("--platform", "cuda", "--unroll", "1", "--out", str(tmp_path / "unrolled")) == {
        "decode": (0, 1, 0, 0), "prefill": (0, 4, 0, 0), "mixed": (0, 5, 0, 0)}
    # the GPU's paged decode kernel: a custom call in place of a one-token attention's loop over key chunks, in
    # the decode step and in a prefill step's last layer, which attends at each row's last token only
    assert run("--platform", "cuda", "--unroll", "1", "--paged-decode", "--out", str(tmp_path / "paged")) == {
        "decode": (0, 0, 1, 0), "prefill": (0, 3, 1, 0), "mixed": (0, 3, 2, 0)}
    mixed = (tmp_path / "loop" / "mixed.mlir").read_text()
    assert mixed.count("// step shape") == 2 and len(re.findall(r"stablehlo\.case\b", mixed)) == 10
    cpu = audit.main([*common, "--platform", "cpu", "--compile", "--out", str(tmp_path / "cpu")])["steps"]
    assert all(s["pool_copies"] == 0 and s["conditionals"] == 5 * len(s["shapes"]) for s in cpu.values())
    generic = audit.main([*common, "--platform", "cpu", "--forms", "generic", "--compile", "--unroll", "1", "--out",
                          str(tmp_path / "generic")])["steps"]
    assert {k: (s["conditionals"], s["while_loops"], s["pool_copies"]) for k, s in generic.items()} == {
        "decode": (0, 1, 0), "prefill": (0, 4, 0), "mixed": (0, 5, 0)}
    assert "decode" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        audit.main([*common, "--platform", "cuda", "--compile", "--out", str(tmp_path / "x")])
    assert "--compile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        audit.main([*common, "--platform", "cpu", "--paged-decode", "--out", str(tmp_path / "x")])
    assert "--paged-decode" in capsys.readouterr().err


def test_qwen35_9b_steps_lowered_for_cuda_hold_no_conditional_and_decode_no_loop(tmp_path):
    """The GPU's forms at the 9B's shapes (abstract: nothing allocated), the layers unrolled and the one-token
    attention by the paged kernel: no conditional in any step, no while loop in the decode step (the prefill keeps
    its chunked rule's and attention's loops)."""
    steps = _script("step_audit").main(["--model", "qwen3.5-9b", "--platform", "cuda", "--unroll", "1",
                                        "--paged-decode", "--out", str(tmp_path)])["steps"]
    assert all(s["conditionals"] == 0 for s in steps.values()) and steps["decode"]["while_loops"] == 0
    assert steps["decode"]["custom_calls"] == 1 and steps["prefill"]["while_loops"] > 0


def test_bench_async_compares_both_schedulings_round_by_round(tmp_path, capsys):
    """Both engines' passes in turns: the same greedy tokens, steps planned ahead only with async scheduling, nothing
    compiled in the measured rounds, and a latency ratio per batch; a --max-tokens too small is refused."""
    out = tmp_path / "async.json"
    bench = _script("bench_async")
    bench.main(["--model", "tiny-random", "--batches", "2", "--max-tokens", "6", "--runs", "2", "--prompt-len", "9",
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["async_scheduling"]) for r in rows] == [(2, False), (2, True)]
    for r in rows:
        assert r["same_tokens"] is True and r["compilations"] == 0 and len(r["runs"]) == 2, r
        assert r["itl_p50_ms"] > 0 and r["decode_tok_s"] > 0 and r["itl_ratio"] == rows[0]["itl_ratio"] > 0
        assert (r["planned_ahead"] > 0) == r["async_scheduling"]
    assert "ITL off/on" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--max-tokens", "2", "--out", str(out)])
    assert "--max-tokens must be at least 3" in capsys.readouterr().err


@pytest.mark.slow  # ~15 s: two engines (k = 0 and k = 1) compile their steps
@pytest.mark.parametrize("interleave", [False, True])  # one engine after another, or both at once in turns
def test_bench_spec_reports_every_k_and_batch(tmp_path, capsys, interleave):
    out = tmp_path / "spec.json"
    _script("bench_spec").main(["--models", "tiny-random", "--ks", "0,1", "--batches", "1", "--max-tokens", "6",
                                "--runs", "2" if interleave else "1", "--max-model-len", "128", "--prompt-len", "16",
                                "--out", str(out)] + ["--interleave"] * interleave)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["model"], r["k"], r["batch"]) for r in rows] == [
        ("tiny-random", k, 1) for k in (0, 1)]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["output_tok_s"] > 0 and r["itl_p50_ms"] > 0, r
        assert r["compilations"] == 0, r  # the warm-up pass compiled every shape
        assert r["same_tokens_as_k0"] is True, r  # greedy: speculation changes no token
        run, *_ = r["runs"]
        assert len(r["runs"]) == 1 + interleave and run["generated_tokens"] == 6 * r["batch"]
        if r["k"] == 0:
            assert r["acceptance"] is None and r["tokens_per_step"] == 1.0 and r["x_k0"] == 1.0
        else:
            assert 0.0 <= r["acceptance"] <= 1.0 and run["draft_tokens"] > 0
            assert 1.0 <= r["tokens_per_step"] <= 2.0 and r["x_k0"] > 0
    if interleave:  # each round's ratio, then their median
        ratios = [a["decode_tok_s"] / z["decode_tok_s"] for a, z in zip(rows[1]["runs"], rows[0]["runs"])]
        assert rows[1]["x_k0"] == pytest.approx(sum(ratios) / 2)
    assert "same as k=0" in capsys.readouterr().out
