"""The CPU's measured choices (gdn_jax/backends/cpu/tuning.py): kept once per machine, resolved once at engine start
into the `Forms` a step is traced in, never measured while tracing."""

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from gdn_jax.backends.cpu import library, tuning
from gdn_jax.model.forms import Forms

pytestmark = pytest.mark.startup


@pytest.fixture(autouse=True)
def without_persistent_cache():
    """JAX's persistent compilation cache off (`make test` may turn it on, tests/conftest.py), so that no choice is
    read from, or written to, a lane's folder."""
    folder = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()


def test_a_measured_choice_is_kept_per_machine_and_measured_again_when_unusable(tmp_path):
    """`remembered` measures a choice once and serves later starts from `choices_file` (one file per CPU kind, an
    entry per name, jax versions and cores); a stored value the caller refuses, or a file that is not JSON, is
    measured again and written anew; with JAX's cache off (this file's fixture) every call measures."""
    calls = []

    def measure(value):
        return lambda: calls.append(value) or value

    either = lambda v: v in (256, 512)  # noqa: E731
    cache = str(tmp_path)
    assert tuning.remembered("width float32", measure(512), either, cache) == 512
    assert tuning.remembered("width float32", measure(256), either, cache) == 512  # kept: not measured
    assert tuning.remembered("width bfloat16", measure(256), either, cache) == 256  # a choice of its own
    assert calls == [512, 256]
    path = tuning.choices_file(cache)
    assert path == tmp_path / "machine" / f"{library.host_cpu()}.json"
    stored = json.loads(path.read_text())
    key = tuning.choice_key("width float32")
    assert sorted(stored) == sorted([key, tuning.choice_key("width bfloat16")])
    assert stored[key]["value"] == 512 and f"jax={jax.__version__} " in key and "cores=" in key

    assert tuning.remembered("width float32", measure(256), lambda v: v == 256, cache) == 256  # refused: measured
    assert json.loads(path.read_text())[key]["value"] == 256
    path.write_text("{not json")
    assert tuning.remembered("width float32", measure(512), either, cache) == 512
    assert json.loads(path.read_text())[key]["value"] == 512 and calls == [512, 256, 256, 512]
    assert not list(path.parent.glob("*.tmp"))

    assert tuning.choices_file() is None
    assert [tuning.remembered("width float32", measure(v), either) for v in (256, 512)] == [256, 512]
    assert calls[-2:] == [256, 512]


def test_a_choice_that_cannot_be_kept_is_measured_and_said_once(tmp_path):
    """A cache folder where the file cannot be written: the measured value is used, one warning names the file, and
    each call measures again."""
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder would be")
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in (512, 256):
            assert tuning.remembered("width float32", lambda v=value: calls.append(v) or v, lambda v: True,
                                     str(blocker)) == value
    said = [str(w.message) for w in caught]
    assert calls == [512, 256] and len(said) == 1 and "cannot be kept" in said[0] and str(blocker) in said[0]


def _write_choices(path, bits: int, upcast: bool, few_rows: bool, kernel_rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({tuning.choice_key(name): {"value": value} for name, value in (
        ("decode_vector_bits bfloat16", bits), ("decode_vector_bits float32", bits), ("bf16_upcast", upcast),
        ("bf16_few_rows_weight_left", few_rows), ("bf16_rows_kernel_chained", kernel_rows),
        ("f32_rows_kernel_chained", kernel_rows // 2))}))


def _clear_choices():
    tuning.forget_measured()  # (the test's own memo: `_measured` is patched)


def test_the_forms_are_read_from_the_kept_choices_without_measuring(tmp_path, monkeypatch):
    """With JAX's cache on, `resolve_forms` takes what the machine's choices file holds (whatever it holds: the
    values come back as written), without measuring; the environment still decides first. A float32 model's forms
    hold none of the 16-bit choices, and its own few-row kernel choice."""
    for name in (tuning.DECODE_VECTOR_BITS_ENV, tuning.UPCAST_ENV, tuning.FEW_ROWS_ENV, tuning.ROWS_KERNEL_ENV,
                 tuning.F32_ROWS_KERNEL_ENV, tuning.UNROLL_ENV, tuning.PREFILL_KV_CHUNK_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tuning, "_measured", {})  # what this process measured or read before: not served here
    real = tuning.remembered
    monkeypatch.setattr(tuning, "remembered", lambda name, measure, valid, cache=None: real(
        name, lambda: pytest.fail(f"measured {name}"), valid, cache))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))  # (the fixture turns it off again)
    kernels = library.available()
    for bits, faster, kernel_rows in ((512, True, 8), (256, False, 16)):
        _write_choices(tuning.choices_file(), bits, faster, not faster, kernel_rows)
        _clear_choices()
        assert tuning.resolve_forms(jnp.bfloat16) == Forms(
            cpu=True, kernels=kernels, bf16_upcast=faster, few_rows_weight_left=not faster,
            rows_kernel_rows=kernel_rows if kernels else 0, decode_vector_bits=bits)
        assert tuning.resolve_forms(jnp.float32) == Forms(cpu=True, kernels=kernels, decode_vector_bits=bits,
                                                          f32_rows_kernel_rows=kernel_rows // 2 if kernels else 0)
    monkeypatch.setenv(tuning.DECODE_VECTOR_BITS_ENV, "512")
    monkeypatch.setenv(tuning.UPCAST_ENV, "1")
    monkeypatch.setenv(tuning.UNROLL_ENV, "decode")
    monkeypatch.setenv(tuning.PREFILL_KV_CHUNK_ENV, "2048")
    _clear_choices()
    forms = tuning.resolve_forms(jnp.bfloat16)
    assert (forms.decode_vector_bits, forms.bf16_upcast, forms.unroll, forms.prefill_kv_chunk_keys) == (
        512, True, "decode", 2048)
    monkeypatch.setenv(tuning.UPCAST_ENV, "0")  # read at every start, not once per process
    assert not tuning.resolve_forms(jnp.bfloat16).bf16_upcast


def test_measuring_again_replaces_the_kept_choices(tmp_path, monkeypatch):
    """`measure_again` (`gdn-jax tune`) deletes the kept choices, measures each anew and keeps it: the forms it
    returns are those a later start reads back."""
    for name in (tuning.DECODE_VECTOR_BITS_ENV, tuning.UPCAST_ENV, tuning.FEW_ROWS_ENV, tuning.ROWS_KERNEL_ENV,
                 tuning.F32_ROWS_KERNEL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tuning, "_measured", {})
    path = tuning.choices_file(str(tmp_path))
    _write_choices(path, 512, True, True, 0)
    stale = json.loads(path.read_text())
    measured = []
    real = tuning.remembered
    monkeypatch.setattr(tuning, "remembered", lambda name, measure, valid, cache=None: real(
        name, lambda: measured.append(name) or measure(), valid, cache or str(tmp_path)))
    resolved = tuning.measure_again(("float32",), cache=str(tmp_path))
    mine = ["f32_rows_kernel_chained", "decode_vector_bits float32"] if library.available() else [
        "decode_vector_bits float32"]
    assert measured == mine  # a float32 model's choices, measured though they were kept
    kept = json.loads(path.read_text())
    assert set(kept) == {tuning.choice_key(name) for name in mine} and kept != stale  # the rest deleted
    assert resolved["float32"].decode_vector_bits == kept[tuning.choice_key("decode_vector_bits float32")]["value"]
    _clear_choices()
    assert tuning.resolve_forms(jnp.float32) == resolved["float32"]  # read back, not measured
    assert measured == mine


_FRESH_PROCESS = """
import json, sys, types, time
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
from gdn_jax import LLM, SamplingParams
from gdn_jax.backends.cpu import tuning
from gdn_jax.model.forms import Forms

path = tuning.choices_file()
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps({tuning.choice_key(name): {"value": value} for name, value in (
    ("decode_vector_bits bfloat16", 512), ("bf16_upcast", True), ("bf16_few_rows_weight_left", True),
    ("bf16_rows_kernel_chained", 8))}))
events = []
clock = time.perf_counter
tuning.time = types.SimpleNamespace(perf_counter=lambda: events.append("clock") or clock(), strftime=time.strftime)
remembered = tuning.remembered
tuning.remembered = lambda name, measure, valid, cache=None: remembered(
    name, lambda: events.append(name) or measure(), valid, cache)
llm = LLM("tiny-random", dtype="bfloat16", block_size=16, chunk_stride=32, max_num_seqs=2, max_model_len=64,
          verbose=False)
assert events == [], events  # the engine's start read every choice, measured none
kernels = llm.engine.worker.forms.kernels
assert llm.engine.worker.forms == Forms(cpu=True, kernels=kernels, bf16_upcast=True, few_rows_weight_left=True,
                                        rows_kernel_rows=8 if kernels else 0, decode_vector_bits=512)

def never(name):
    def called(*args, **kwargs):
        events.append(name)
        raise AssertionError(f"tuning.{name} called after the engine's start")
    return called

for name in ("resolve_forms", "product_forms", "measure_again", "upcast_is_faster", "few_rows_weight_left",
             "rows_kernel_rows", "decode_vector_bits", "remembered", "measured_choice", "seconds_of", "choices_file",
             "choice_key", "_chained", "_best_seconds", "_seconds_at"):
    setattr(tuning, name, never(name))
out = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]],
                   SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 3 and events == [], events  # prefill and decode traced: nothing of tuning
print("traced", llm.engine.worker.num_compilations, "steps")
"""


def test_a_fresh_process_with_the_kept_choices_measures_nothing_and_traces_without_tuning(tmp_path):
    """In a fresh process with the machine's choices file present, the engine's start reads every choice (a 16-bit
    model's: all of them) into its forms and measures none (no clock read, no measurement run), and tracing its
    prefill and decode steps calls nothing of tuning.py: every measurement and the file's functions raise there."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GDN_JAX_CACHE_DIR": "off"}
    for name in (tuning.DECODE_VECTOR_BITS_ENV, tuning.UPCAST_ENV, tuning.FEW_ROWS_ENV, tuning.ROWS_KERNEL_ENV):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "traced" in run.stdout and not run.stdout.startswith("traced 0 ")


_MODEL_ALONE = """
import inspect
import jax, jax.numpy as jnp, numpy as np
from gdn_jax import envs
from gdn_jax.backends.cpu import library, tuning
from gdn_jax.config import get_preset
from gdn_jax.model.forms import Forms
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import Batch, init_state

kernels = library.available()  # (it registers the kernels with XLA, before the trace)

def forbidden(what):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} called while tracing the model")
    return called

envs.Variable.get = forbidden("an environment read")
library.available = forbidden("library.available")
jax.default_backend = forbidden("jax.default_backend")
for name, fn in inspect.getmembers(tuning, inspect.isfunction):
    setattr(tuning, name, forbidden(f"tuning.{name}"))
cfg = get_preset("tiny-random")
for dtype in (jnp.float32, jnp.bfloat16):
    graphdef, params = init_model(cfg, dtype=dtype)
    for forms in (Forms(), Forms(cpu=True, kernels=kernels, bf16_upcast=True, few_rows_weight_left=True,
                                 rows_kernel_rows=16 if kernels else 0, unroll="decode")):
        for T in (1, 3, 40):
            batch = Batch(tokens=jnp.ones((2, T), jnp.int32), start_pos=jnp.zeros(2, jnp.int32),
                          lengths=jnp.full(2, T, jnp.int32), block_tables=jnp.ones((2, 4), jnp.int32),
                          slot_mapping=jnp.zeros((2, T), jnp.int32), linear_state_ids=jnp.ones(2, jnp.int32),
                          has_initial_state=jnp.zeros(2, bool))
            jax.jit(lambda p, b, s: forward(graphdef, p, b, s, forms=forms)).lower(
                params, batch, init_state(cfg, 5, 16, 3, dtype))
print("ok")
"""


def test_tracing_the_model_measures_nothing_reads_no_environment_and_asks_no_backend():
    """The model's code takes every choice from its `Forms` argument: traced in a fresh process in the generic forms
    and in the CPU's (kernels, every 16-bit form, unrolled decode), with every function of tuning.py, environment
    reads, `library.available` and `jax.default_backend` made to raise. And no module of the model imports tuning.py,
    the environment or a clock."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_MODEL_ALONE)],
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    model = Path(tuning.__file__).resolve().parents[2] / "model"
    for path in model.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        assert not {n for n in names if n.split(".")[-1] in ("tuning", "envs", "time", "os")}, path.name


def test_the_default_forms_are_xla_generic_and_forms_refuse_what_cannot_be():
    forms = Forms()
    assert (forms.cpu, forms.kernels, forms.rows_kernel_rows, forms.unroll) == (False, False, 0, "0")
    assert hash(forms) == hash(Forms()) and dataclasses.replace(forms, cpu=True) != forms
    with pytest.raises(ValueError, match="kernels=True needs cpu=True"):
        Forms(kernels=True)
    with pytest.raises(ValueError, match="Forms.unroll must be one of"):
        Forms(unroll="yes")
    with pytest.raises(ValueError, match="Forms.decode_vector_bits must be one of"):
        Forms(decode_vector_bits=1024)
    with pytest.raises(ValueError, match="Forms.rows_kernel_rows"):
        Forms(cpu=True, rows_kernel_rows=8)
    assert Forms(unroll="decode").unrolled(1) and not Forms(unroll="decode").unrolled(2)
    assert Forms(unroll="1").unrolled(5) and not Forms().unrolled(1)
