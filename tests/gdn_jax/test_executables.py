"""The executable store (gdn_jax.worker.executable_store): a second worker loads every warm-up executable without lowering and
generates exactly what the first did; a key changes with anything that changes the executable; a bad entry is a
miss, never an error."""

import dataclasses
import os
import re
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from gdn_jax.backends.cpu import library
from gdn_jax import LLM, SamplingParams
from gdn_jax.model.forms import Forms
from gdn_jax.worker import executable_store as executables
from tests.gdn_jax.helpers import own_cache_env, random_ids

pytestmark = pytest.mark.startup

KW = dict(block_size=16, chunk_stride=32, max_num_seqs=2, max_model_len=64, verbose=False)


def _generate(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _with_store(folder, **settings):
    """tiny-random, its worker's executable store in `folder`."""
    llm = LLM("tiny-random", **settings)
    llm.engine.worker.executable_dir = str(folder)
    return llm


def _entries(folder) -> int:
    return len([p for p in folder.iterdir() if not p.name.endswith(".tmp")])


@pytest.fixture(autouse=True)
def without_persistent_cache():
    """JAX's persistent compilation cache off in this file (`make test` turns it on, tests/conftest.py): what the
    tests save must have been compiled, not loaded from that cache (on the CPU such a load cannot be serialized
    again: the copy fails at dispatch)."""
    folder = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()


@pytest.mark.slow  # compiles the tiny grid once (~30 s on a quiet machine)
def test_a_second_start_loads_every_warm_up_executable_and_generates_the_same(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    prompts = [random_ids(rng, n) for n in (5, 40, 21)]
    first = _with_store(tmp_path, **KW)
    n = first.engine.warm_up() + len(first.engine.worker.sample_buckets())
    assert first.engine.worker.warm_up_stats == {"loaded": 0, "compiled": n}
    assert _entries(tmp_path) == n
    want = _generate(first, prompts)

    second = _with_store(tmp_path, **KW)
    worker = second.engine.worker
    lowered = []
    worker.lowered_step = lambda shape: lowered.append(shape)  # a hit must not lower
    second.engine.warm_up()
    assert worker.warm_up_stats == {"loaded": n, "compiled": 0} and not lowered
    warm = second.cache_stats()["compilations"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _generate(second, prompts) == want
    # every step ran a loaded executable, unless XLA stored one without a kernel it needs (it happened in this
    # suite's runs: the store deletes those of the failed step, as below, and they compile again)
    if len(worker._stored) == n:
        assert second.cache_stats()["compilations"] == warm

    # A stored executable that fails at its call for a kernel it lacks (as XLA's CPU runtime reports it) is deleted
    # from the store and compiled again, and its step recomputed: no request fails.
    third = _with_store(tmp_path, **KW)
    worker = third.engine.worker
    third.engine.warm_up()

    def lacking(name):
        def call(*args):
            if name[0] == "step":  # the failed call consumed the donated state
                for x in jax.tree.leaves(args[1]):
                    x.delete()
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function convert_bitcast_fusion.3 not found (type id: 1)")
        return call

    stored = dict(worker._stored)
    for name in stored:
        worker._executables[name] = lacking(name)
    with pytest.warns(RuntimeWarning, match="a step failed in a stored executable .* deleted from the executable "
                      "store") as caught:
        assert _generate(third, prompts) == want
    dropped = {name for name in stored if name not in worker._executables}
    assert {n[0] for n in dropped} == {"step", "sample"}
    warned = [str(w.message) for w in caught if "stored executable" in str(w.message)]
    assert all(any(f"{n[0]} {n[1:]}" in w for w in warned) for n in dropped)
    assert all(not (tmp_path / stored[name]).exists() and (tmp_path / (stored[name] + ".bad")).exists()
               for name in dropped)
    assert all((tmp_path / stored[name]).exists() for name in stored if name not in dropped)
    stats = third.cache_stats()
    assert stats["redone_steps"] == len(warned) and stats["failed_steps"] == 0

    # one that fails in warm-up's own run of its shape: the same, before any request
    name = next(n for n in stored if n not in dropped and n[0] == "step")
    real_load = executables.load
    monkeypatch.setattr(executables, "load", lambda folder, key: lacking(name) if key == stored[name] else real_load(
        folder, key))
    fourth = _with_store(tmp_path, **KW)
    with pytest.warns(RuntimeWarning, match=re.escape(f"deleted from the executable store, compiled again: step {name[1:]}")):
        fourth.engine.warm_up()
    assert fourth.engine.worker.state_resets >= 1 and not (tmp_path / stored[name]).exists()
    # the executables deleted before were compiled by this warm-up, and not stored again
    assert fourth.engine.worker.warm_up_stats["compiled"] >= len(dropped)
    assert not any((tmp_path / stored[n]).exists() for n in dropped)
    assert _generate(fourth, prompts) == want


def test_speculations_executables_are_stored_and_loaded_on_the_next_start(tmp_path, monkeypatch):
    """With MTP speculation every step runs a spec executable (prefill, verify): the first start stores them all, a
    second loads them all without lowering any and decodes the same tokens, and one that no longer runs is dropped
    from the store and compiled at warm-up."""
    spec = dict(KW, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompts = [random_ids(np.random.default_rng(5), n) for n in (7, 33)]
    first = _with_store(tmp_path, **spec)
    n = first.engine.warm_up()
    assert n == len(first.engine.worker.spec_shapes()) and {k for k, _, _ in first.engine.worker.spec_shapes()} == {
        "prefill", "verify"}
    assert first.engine.worker.warm_up_stats == {"loaded": 0, "compiled": n}
    assert _entries(tmp_path) == n
    want = _generate(first, prompts)

    second = _with_store(tmp_path, **spec)
    worker = second.engine.worker
    monkeypatch.setattr(worker, "_lower_spec", lambda kind, _: pytest.fail(f"a stored {kind} executable lowered"))
    second.engine.warm_up()
    assert worker.warm_up_stats == {"loaded": n, "compiled": 0} and len(worker._stored) == n
    assert _generate(second, prompts) == want
    monkeypatch.undo()

    name, key = next((name, key) for name, key in worker._stored.items() if name[0] == "verify")
    real_load = executables.load

    def lacking(*args):
        for x in jax.tree.leaves(args[1]):  # the failed call consumed the donated state
            x.delete()
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function convert_bitcast_fusion.3 not found (type id: 1)")

    monkeypatch.setattr(executables, "load", lambda folder, k: lacking if k == key else real_load(folder, k))
    third = _with_store(tmp_path, **spec)
    with pytest.warns(RuntimeWarning, match=re.escape(f"deleted from the executable store, compiled again: verify "
                                                      f"{name[1:]}")):
        third.engine.warm_up()
    assert third.engine.worker.warm_up_stats == {"loaded": n, "compiled": 0} and not (tmp_path / key).exists()
    assert third.engine.worker.state_resets >= 1 and name not in third.engine.worker._stored
    assert _generate(third, prompts) == want


@pytest.mark.slow  # compiles the tiny grid twice
def test_an_executable_stored_while_jax_cache_holds_its_program_runs_on_the_next_start(tmp_path):
    """The store misses after any source edit (its key holds the source digest), JAX's persistent cache does not when
    the compiled program is unchanged; what warm-up then stores must still run: it is compiled afresh, not the
    cache's load (which on the CPU cannot be serialized again: the copy fails at its first call). When an engine of
    the process had loaded the program from JAX's cache, even a fresh compilation's copy lacks kernels: the next start
    recomputes the steps that meet them and stops storing those executables."""
    rng = np.random.default_rng(5)
    prompts = [random_ids(rng, n) for n in (7, 30)]
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    compilation_cache.reset_cache()
    jax.clear_caches()  # the other tests' executables of the same grid: compiled again, into that cache
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        plain = LLM("tiny-random", **KW)  # store off: fills JAX's cache with every program of the grid
        plain.engine.warm_up()
        want = _generate(plain, prompts)
        assert any((tmp_path / "jax").iterdir())
        jax.clear_caches()  # as in a new process: what is not in JAX's persistent cache compiles again
        again = LLM("tiny-random", **KW)  # store off: loads the programs from JAX's cache (held in memory since)
        again.engine.warm_up()
        edited = LLM("tiny-random", **KW)  # as after an edit: a store without these keys
        edited.engine.worker.executable_dir = str(tmp_path / "store")
        edited.engine.warm_up()
        assert edited.engine.worker.warm_up_stats["loaded"] == 0
        assert jax.config.jax_enable_compilation_cache  # back on after warm-up
        restarted = LLM("tiny-random", **KW)
        restarted.engine.worker.executable_dir = str(tmp_path / "store")
        # XLA's CPU runtime: a program compiled in a process that had loaded it from JAX's cache (`again`) runs, but
        # its stored copy lacks kernels. Warm-up's run of a shape, or a step, that meets one is run again compiled
        # anew (no request fails), and the store deletes and marks the executables it called ...
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restarted.engine.warm_up()
            assert restarted.engine.worker.warm_up_stats["compiled"] == 0
            assert _generate(restarted, prompts) == want
        stale = [str(w.message) for w in caught if "a step failed in a stored executable" in str(w.message)]
        assert stale and restarted.cache_stats()["failed_steps"] == 0
        assert len(list((tmp_path / "store").glob("*.bad"))) >= len(stale)
        # ... so that the next start compiles those without storing them, and recomputes nothing
        fourth = LLM("tiny-random", **KW)
        fourth.engine.worker.executable_dir = str(tmp_path / "store")
        fourth.engine.warm_up()
        assert _generate(fourth, prompts) == want and fourth.cache_stats()["redone_steps"] == 0
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)


SMALL = dict(verbose=False, max_num_seqs=1, max_model_len=64, chunk_stride=16, max_num_batched_tokens=16)


@pytest.mark.slow  # compiles the 3 executables of a one-row grid three times
def test_a_jax_setting_that_changes_the_program_is_not_served_another_settings_executable(tmp_path):
    """jax_threefry_partitionable changes how sampling draws its random bits (the program), not the arguments: an
    engine started with the other value must not load the executables stored under this one, and must sample what it
    samples without the store."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)

    def start(folder):
        llm = LLM("tiny-random", **SMALL)
        llm.engine.worker.executable_dir = folder
        llm.engine.warm_up()
        return llm.engine.worker.warm_up_stats, llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids

    stored, _ = start(str(tmp_path))
    assert stored["loaded"] == 0
    flag = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", not flag)
    try:
        _, want = start(None)
        stats, got = start(str(tmp_path))
    finally:
        jax.config.update("jax_threefry_partitionable", flag)
    assert stats == {"loaded": 0, "compiled": stored["compiled"]} and got == want


def test_the_key_follows_shapes_dtypes_structure_options_and_context(monkeypatch):
    args = (jnp.zeros((2, 3)), {"a": np.zeros(4, np.int32)})
    key = executables.executable_key("step", ("cfg", 64), args, {"o": False})
    assert key == executables.executable_key("step", ("cfg", 64), args, {"o": False})
    others = [executables.executable_key("step", ("cfg", 32), args, {"o": False}),
              executables.executable_key("sample", ("cfg", 64), args, {"o": False}),
              executables.executable_key("step", ("cfg", 64), args, {"o": True}),
              executables.executable_key("step", ("cfg", 64), (jnp.zeros((2, 4)), args[1]), {"o": False}),
              executables.executable_key("step", ("cfg", 64), (args[0], {"a": np.zeros(4, np.int64)}), {"o": False}),
              executables.executable_key("step", ("cfg", 64), (args[0], {"b": args[1]["a"]}), {"o": False})]
    for name, value in (("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false"), ("GDN_JAX_UNROLL_LAYERS", "1"),
                        ("GDN_JAX_PREFILL_KV_CHUNK_KEYS", "2048")):
        with monkeypatch.context() as m:  # the environment that changes a compiled program is part of the key
            m.setenv(name, value)
            others.append(executables.executable_key("step", ("cfg", 64), args, {"o": False}))
    for name in ("jax_threefry_partitionable", "jax_high_dynamic_range_gumbel"):  # JAX settings that change a program
        value = getattr(jax.config, name)
        jax.config.update(name, not value)
        try:
            others.append(executables.executable_key("step", ("cfg", 64), args, {"o": False}))
        finally:
            jax.config.update(name, value)
    device = jax.devices()[0]
    other_runtime = type("Device", (), {"platform": device.platform, "device_kind": device.device_kind,
                                        "client": type("Client", (), {"platform_version": "cuda 99000"})()})()
    with monkeypatch.context() as m:  # the same device kind under another backend version (a GPU's CUDA, driver)
        m.setattr(executables.jax, "devices", lambda: [other_runtime])
        others.append(executables.executable_key("step", ("cfg", 64), args, {"o": False}))
    assert len({key, *others}) == 1 + len(others)


def test_the_key_holds_the_forms_the_step_is_traced_in():
    """The key holds the step's `Forms` (`machine_choices`): each choice resolved at start (whether the kernels are
    used, the product forms measured faster on this machine, the decode steps' vector width, the environment's
    settings of the trace) changes the compiled program."""
    base = Forms(cpu=True, kernels=True)
    variants = [Forms(), base, *(dataclasses.replace(base, **{name: value}) for name, value in (
        ("bf16_upcast", True), ("few_rows_weight_left", True), ("rows_kernel_rows", 8),
        ("prefill_kv_chunk_keys", 2048), ("unroll", "decode"), ("decode_vector_bits", 512)))]
    args = (jnp.zeros((2, 3), jnp.bfloat16),)
    keys = {executables.executable_key("step", ("cfg", 32), args, None, forms) for forms in variants}
    assert len(keys) == len(variants)


CPUINFO = """processor\t: {n}
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 17
model name\t: AMD EPYC 9B45
cpu MHz\t\t: {mhz}
core id\t\t: {n}
flags\t\t: {flags}
bogomips\t: 5200.00
"""
FLAGS = "fpu sse2 avx2 avx512f avx512_bf16"


def test_the_host_cpu_tag_follows_the_cpu_kind_and_its_instruction_sets_not_clock_or_core():
    one = library.host_cpu(CPUINFO.format(n=0, mhz="2600.0", flags=FLAGS))
    assert re.fullmatch(r"\S+-[0-9a-f]{12}", one)
    two_cores = "\n".join(CPUINFO.format(n=n, mhz=mhz, flags=FLAGS) for n, mhz in ((0, "3100.2"), (1, "1500.0")))
    assert library.host_cpu(two_cores) == one  # the first processor; clock and core id left out
    assert library.host_cpu(CPUINFO.format(n=0, mhz="2600.0", flags="avx2 fpu sse2 avx512_bf16 avx512f")) == one
    fewer = library.host_cpu(CPUINFO.format(n=0, mhz="2600.0", flags="fpu sse2 avx2"))  # no AVX-512
    other_model = library.host_cpu(CPUINFO.format(n=0, mhz="2600.0", flags=FLAGS).replace("model\t\t: 17",
                                                                                           "model\t\t: 2"))
    assert len({one, fewer, other_model}) == 3
    assert library.host_cpu() == library.host_cpu()  # this machine's


def test_the_store_key_holds_the_host_cpu(monkeypatch):
    """Two kinds of machine sharing a store keep their executables apart (one could not load the other's, or would
    run code tuned for the other CPU)."""
    args = (jnp.zeros((2, 3)),)
    keys = set()
    for tag in ("x86_64-aaaaaaaaaaaa", "x86_64-bbbbbbbbbbbb"):
        monkeypatch.setattr(library, "host_cpu_tag", lambda tag=tag: tag)
        keys.add(executables.executable_key("step", ("cfg", 64), args, None))
        assert executables.executable_key("step", ("cfg", 64), args, None) in keys
    assert len(keys) == 2


def test_a_corrupt_or_missing_entry_is_a_miss(tmp_path):
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile()
    assert executables.save(str(tmp_path), "k", compiled)
    assert np.array_equal(executables.load(str(tmp_path), "k")(jnp.ones(3)), [2.0, 2.0, 2.0])
    (tmp_path / "k").write_bytes(b"not an executable")
    with pytest.warns(RuntimeWarning, match="does not load"):
        assert executables.load(str(tmp_path), "k") is None
    assert executables.load(str(tmp_path), "absent") is None and executables.load(None, "k") is None
    assert not executables.save(None, "k", compiled)


_DAMAGED_CHILD = """
import sys
import jax, jax.numpy as jnp, numpy as np
from gdn_jax.worker import executable_store as executables
folder = sys.argv[1]
compiled = jax.jit(lambda x: jnp.sin(x) * 2 + jnp.cumsum(x)).lower(jnp.ones(64)).compile()
assert executables.save(folder, "k", compiled)
path = folder + "/k"
data = open(path, "rb").read()
for at in np.linspace(0.02, 0.98, 25):
    damaged = bytearray(data)
    damaged[int(len(data) * at)] ^= 1
    open(path, "wb").write(bytes(damaged))
    if executables.load(folder, "k") is not None:  # (not called: it could crash the process)
        print("loaded", round(at, 2), flush=True)
open(path, "wb").write(data)
assert np.array_equal(executables.load(folder, "k")(jnp.ones(64)), compiled(jnp.ones(64)))
print("done")
"""


def test_an_entry_damaged_in_its_executable_is_a_miss(tmp_path):
    """A bit changed anywhere in an entry (on the disk, in a copy) is a miss: deserializing does not check the
    executable, and a damaged one loaded, then computed wrong values or stopped the process at its first call, or
    stopped it in the load itself (XLA aborts). Run in a process of its own, which such a load would end."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DAMAGED_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.split() == ["done"]


def test_a_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk (the write fails halfway), a failed rename or an interrupt: no entry, and no partial file left
    behind, which no eviction counts or deletes."""
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile()
    real = executables.tempfile.NamedTemporaryFile

    def full_disk(*args, **kwargs):
        f = real(*args, **kwargs)

        def write(data):
            f.file.write(data[:len(data) // 2])
            f.file.flush()
            raise OSError(28, "No space left on device")
        f.write = write
        return f

    with monkeypatch.context() as m:
        m.setattr(executables.tempfile, "NamedTemporaryFile", full_disk)
        with pytest.warns(RuntimeWarning, match="No space left on device"):
            assert not executables.save(str(tmp_path), "k", compiled)
    with monkeypatch.context() as m:
        m.setattr(executables.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(18, "Cross-device link")))
        assert not executables.save(str(tmp_path), "k", compiled)
    assert list(tmp_path.iterdir()) == []

    def interrupted(*args, **kwargs):  # Ctrl-C while warm-up writes an entry
        f = real(*args, **kwargs)
        f.write = lambda data: (_ for _ in ()).throw(KeyboardInterrupt())
        return f

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(executables.tempfile, "NamedTemporaryFile", interrupted)
        executables.save(str(tmp_path), "k", compiled)
    assert list(tmp_path.iterdir()) == []
    assert executables.save(str(tmp_path), "k", compiled) and [p.name for p in tmp_path.iterdir()] == ["k"]


def test_a_store_that_cannot_be_written_or_holds_a_damaged_entry_says_so_once(tmp_path, monkeypatch):
    """A read-only folder (or a full disk): every save fails, the engine compiles as without a store, and one warning
    per folder says why (else every start compiled everything with nothing to say why). A damaged entry: one warning
    naming it, then a miss (warm-up compiles and replaces it)."""
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))

    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.setattr(executables.tempfile, "NamedTemporaryFile", read_only)
        assert not any([executables.save(str(tmp_path), key, compiled) for key in ("a", "b", "c")])
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and all(part in said[0] for part in (str(tmp_path), "Permission denied", "cannot be written"))

    assert executables.save(str(tmp_path), "k", compiled)
    (tmp_path / "k").write_bytes((tmp_path / "k").read_bytes()[:-1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert executables.load(str(tmp_path), "k") is None and executables.load(str(tmp_path), "k") is None
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and str(tmp_path / "k") in said[0] and "does not load" in said[0]


_DENIED_CHILD = """
import sys, warnings
import jax, jax.numpy as jnp
from gdn_jax.worker import executable_store as executables
warnings.simplefilter("always")
compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("load", executables.load(sys.argv[1], "k"), "save", executables.save(sys.argv[1], "k", compiled))
print("warnings", len(caught), *(str(w.message) for w in caught), sep="\\n")
"""


def test_a_store_folder_this_user_may_not_enter_is_a_miss(tmp_path):
    """A store folder of another user (a shared cache folder, mode 700): looking an entry up is refused (EACCES). A
    look-up and a save are misses that say so, as for a read-only folder; they raised PermissionError, and warm-up
    with them. Run in a process of its own: as root it drops the right to pass permission checks (setpriv)."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "executables" / "v"
    folder.mkdir(parents=True)
    folder.chmod(0)
    command = [sys.executable, "-c", _DENIED_CHILD, str(folder)]
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        setpriv = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
        if not shutil.which("setpriv") or subprocess.run([*setpriv, "true"], capture_output=True).returncode:
            pytest.skip("as root, needs setpriv (and the right to drop capabilities) to be refused")
        command = [*setpriv, *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
    finally:
        folder.chmod(0o700)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "load None save False" and lines[1] == "warnings" and lines[2] == "2", done.stdout
    assert all("Permission denied" in line and str(folder) in line for line in lines[3:5]), done.stdout


def test_the_store_keeps_the_most_recently_used_source_versions(tmp_path):
    """One subfolder per source version; opening the store deletes all but the KEEP_VERSIONS most recently used ones
    and the entries of the former flat layout, and never the current version's."""
    root = tmp_path / "executables"
    root.mkdir()
    for i, name in enumerate(["v0", "v1", "v2", "v3"]):  # v3 the most recent
        (root / name).mkdir()
        (root / name / "entry").write_bytes(b"x")
        os.utime(root / name, (1000 + i, 1000 + i))
    (root / "flat-entry").write_bytes(b"x")
    folder = executables.default_folder(str(tmp_path))
    assert folder == str(root / executables.source_digest()[:16])
    kept = sorted(p.name for p in root.iterdir())
    assert kept == sorted([Path(folder).name] + ["v3", "v2"][:executables.KEEP_VERSIONS - 1])
    assert executables.default_folder(str(tmp_path)) == folder and Path(folder).is_dir()  # reopened: kept


def test_opening_the_store_deletes_partial_writes_left_by_a_killed_process(tmp_path):
    """A save killed between writing its `.tmp` file and renaming it leaves the file, which no bound counts: opening
    the store deletes those older than STALE_PARTIAL_S in every version kept, and no younger one (another process may
    be writing it); they were never deleted."""
    folder = Path(executables.default_folder(str(tmp_path)))
    other = folder.parent / "v-other"
    other.mkdir()
    stale = [folder / "tmpa1.tmp", other / "tmpb2.tmp"]
    fresh = [folder / "tmpc3.tmp", folder / "tmpd4.tmp"]
    old = time.time() - getattr(executables, "STALE_PARTIAL_S", 3600) - 60
    for path in stale + fresh + [folder / "entry"]:
        path.write_bytes(b"partial")
    for path in stale + [folder / "entry"]:
        os.utime(path, (old, old))
    os.utime(fresh[1], (old + 120, old + 120))  # written within the last STALE_PARTIAL_S: kept
    assert executables.default_folder(str(tmp_path)) == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["entry", "tmpc3.tmp", "tmpd4.tmp"]
    assert not list(other.iterdir())


def test_the_store_is_bounded_and_deletes_the_least_recently_used_entries(tmp_path):
    """Past the bound a save deletes the least recently used entries of every source version (a load marks an entry
    used), never the one it wrote; without a bound nothing goes; a folder outside the store is bounded alone."""
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
    root = tmp_path / "executables"
    old, new = root / "v-old", root / "v-new"
    assert executables.save(str(old), "a", compiled, max_bytes=-1)
    size = (old / "a").stat().st_size
    for key in ["b", "c"]:
        assert executables.save(str(new), key, compiled, max_bytes=-1)
    for i, path in enumerate([old / "a", new / "b", new / "c"]):  # a, b, c from oldest to newest
        os.utime(path, (1000 + i, 1000 + i))
    assert executables.load(str(new), "b") is not None  # b used now: the most recent
    assert executables.save(str(new), "d", compiled, max_bytes=int(2.5 * size))
    assert sorted(p.name for p in new.iterdir()) == ["b", "d"] and not list(old.iterdir())  # a, then c went
    assert executables.save(str(new), "e", compiled, max_bytes=size // 2)  # below one entry: only the new one stays
    assert [p.name for p in new.iterdir()] == ["e"]
    assert executables.evict(str(new), -1) == 0 and executables.load(str(new), "e") is not None
    outside = tmp_path / "elsewhere"
    (tmp_path / "bystander").write_bytes(b"x" * (4 * size))
    assert executables.save(str(outside), "f", compiled, max_bytes=size)
    assert (tmp_path / "bystander").exists() and [p.name for p in outside.iterdir()] == ["f"]


def test_compile_threads_and_executable_kinds(monkeypatch):
    from gdn_jax.worker import compilation as w

    monkeypatch.setenv("GDN_JAX_COMPILE_THREADS", "3")
    assert w.compile_threads_default() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("GDN_JAX_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="GDN_JAX_COMPILE_THREADS"):
            w.compile_threads_default()
    monkeypatch.delenv("GDN_JAX_COMPILE_THREADS")
    assert 1 <= w.compile_threads_default() <= w.COMPILE_THREADS_MAX
    wide = w.DECODE_DEFAULT_EMITTER_ROWS
    shapes = ((1, 16), (wide, 32), (1, 64), (wide, 2048), (1, 1), (wide - 1, 1), (wide, 1), (64, 1))
    assert [w.executable_kind(B, T) for B, T in shapes] == \
        ["prefill", "prefill", "prefill", "prefill", "decode", "decode", "decode_wide", "decode_wide"]
    # on the CPU backend: the LLVM IR emitters everywhere but wide decode steps, which keep XLA's defaults; prefill
    # steps compile at LLVM's O1 unless XLA_FLAGS names a level; narrow decode steps also vectorise at the width
    # measured the faster for the model's dtype
    assert w.compiler_options("decode_wide") is None
    assert w.compiler_options("sample") == {"xla_cpu_use_fusion_emitters": False}
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert w.compiler_options("prefill") == {"xla_cpu_use_fusion_emitters": False,
                                             "xla_backend_optimization_level": 1}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert w.compiler_options("prefill") == {"xla_cpu_use_fusion_emitters": False}
    with pytest.raises(ValueError, match="kind"):
        w.compiler_options("prefill_long")
    for bits in (256, 512):  # the width of the step's forms (measured for the model's dtype: `tuning`)
        assert w.compiler_options("decode", Forms(cpu=True, decode_vector_bits=bits)) == {
            "xla_cpu_use_fusion_emitters": False, "xla_cpu_prefer_vector_width": bits}
    with pytest.raises(ValueError, match="forms"):
        w.compiler_options("decode")
    with pytest.raises(ValueError, match="kind"):
        w.compiler_options("prompt")


def test_each_step_shape_runs_the_jitted_function_of_its_kind():
    """Each step shape is compiled with its kind's options: its jitted function is the worker's own for that kind
    (every prefill chunk, short or long, one; narrow and wide decode steps one each)."""
    from gdn_jax.worker import compilation as w

    worker = LLM("tiny-random", **KW).engine.worker
    wide = w.DECODE_DEFAULT_EMITTER_ROWS
    shapes = ((1, 16), (2, 32), (1, 64), (2, 2048), (1, 1), (wide - 1, 1), (wide, 1), (64, 1))
    fns = {(B, T): worker._fn_for(np.zeros((B, T), np.int32)) for B, T in shapes}
    assert fns[1, 16] is fns[2, 32] is fns[1, 64] is fns[2, 2048] is worker._fn
    assert fns[1, 1] is fns[wide - 1, 1] is worker._decode_fn and fns[wide, 1] is fns[64, 1] is worker._decode_wide_fn
    assert len({id(f) for f in fns.values()}) == 3


def test_lowering_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    import gc

    from gdn_jax.worker import compilation as w, step

    traced = []
    real = step.forward
    monkeypatch.setattr(step, "forward", lambda *args, **kw: (traced.append(gc.isenabled()), real(*args, **kw))[1])
    step.step_function.cache_clear()  # jitted afresh: lowering traces the step (calls forward) again
    worker = LLM("tiny-random", **KW).engine.worker
    assert gc.isenabled()
    worker.lowered_step(worker.shape_buckets()[0])
    assert traced == [False] and gc.isenabled()
    with w.gc_paused():  # nested (or concurrent) users: the collector runs again once the last one leaves
        with w.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a collector its caller turned off stays off
    try:
        with w.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_warm_up_rejects_no_compile_threads():
    llm = LLM("tiny-random", **KW)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="compile_threads"):
            llm.engine.worker.warm_up(compile_threads=bad)


_CACHE_CHILD = """
import os, sys
import jax, jax.numpy as jnp
from gdn_jax.worker.compile_cache import enable_compilation_cache
if len(sys.argv) > 2:  # "read-only": the folder cannot be written
    os.access = lambda path, mode: not mode & os.W_OK
folder = enable_compilation_cache()
assert folder == os.environ["GDN_JAX_CACHE_DIR"], folder
print("max_size", jax.config.jax_compilation_cache_max_size)
x = jnp.arange(64.0)
for n in range(1, int(sys.argv[1]) + 1):  # distinct programs (one entry each, named jit_program-...)
    def program(x):
        return jnp.sin(x) * n + jnp.cumsum(x) ** n
    jax.jit(program)(x).block_until_ready()
"""


def _cache_child(folder, max_mb, programs, *flags):
    import subprocess
    import sys

    env = own_cache_env(GDN_JAX_CACHE_DIR=str(folder), GDN_JAX_CACHE_MAX_MB=max_mb, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _CACHE_CHILD, str(programs), *flags], env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_persistent_cache_is_bounded_and_evicts_the_least_recently_used_entries(tmp_path):
    """An engine's cache folder stays under GDN_JAX_CACHE_MAX_MB: an entry written before, without the access stamp
    JAX's eviction reads (an older version's), gets its modification time as its stamp and goes first."""
    old = tmp_path / "jit_old-0123-cache"
    old.write_bytes(os.urandom(1000 << 10))
    os.utime(old, (1, 1))
    done = _cache_child(tmp_path, "1", 6)
    assert done.returncode == 0, done.stderr
    assert "max_size 1048576" in done.stdout
    entries = list(tmp_path.glob("*-cache"))
    assert not old.exists() and not (tmp_path / "jit_old-0123-atime").exists()
    assert len(list(tmp_path.glob("jit_program-*-cache"))) == 6 and sum(p.stat().st_size for p in entries) <= 1 << 20
    assert all(p.with_name(p.name.removesuffix("-cache") + "-atime").exists() for p in entries)


def test_the_cache_bound_can_be_lifted_is_off_on_a_read_only_folder_and_a_bad_one_is_named(tmp_path):
    old = tmp_path / "jit_old-0123-cache"
    old.write_bytes(os.urandom(1000 << 10))
    done = _cache_child(tmp_path, "-1", 2)  # no bound: nothing evicted, nothing stamped
    assert done.returncode == 0, done.stderr
    assert "max_size -1" in done.stdout and old.exists() and not list(tmp_path.glob("*-atime"))
    assert len(list(tmp_path.glob("jit_program-*-cache"))) == 2
    done = _cache_child(tmp_path, "1", 1, "read-only")  # a folder it cannot write: read as it is, unbounded
    assert done.returncode == 0, done.stderr
    assert "max_size -1" in done.stdout and old.exists() and not list(tmp_path.glob("*-atime"))
    for bad in ("0", "lots", "1.5"):
        done = _cache_child(tmp_path / bad, bad, 1)
        assert done.returncode != 0 and "GDN_JAX_CACHE_MAX_MB must be a positive whole number" in done.stderr
        assert repr(bad) in done.stderr


_DAMAGED_CACHE_CHILD = """
import json, warnings
import jax, jax.numpy as jnp, numpy as np
from gdn_jax.worker.compile_cache import enable_compilation_cache
enable_compilation_cache()
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kwargs: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(lambda x: jnp.sin(x) * 3 + jnp.cumsum(x))(np.arange(64.0)).block_until_ready()
print(json.dumps({"hits": len(hits), "warnings": [str(w.message) for w in caught]}))
"""


def test_a_damaged_entry_of_jax_cache_warns_at_one_start_not_at_every_one(tmp_path):
    """JAX reads an entry that does not load (here truncated) as a miss, with a warning, and never replaces an entry
    that is there: every later start warned and compiled it again. The engine deletes it, so the start that finds it
    writes it anew. Three starts on one folder: the first writes the entry, the second finds it damaged, the third
    loads what the second wrote."""
    import json
    import subprocess
    import sys

    def start():
        env = own_cache_env(GDN_JAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-c", _DAMAGED_CACHE_CHILD], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    assert start() == {"hits": 0, "warnings": []}
    (entry,) = tmp_path.glob("*-cache")
    entry.write_bytes(entry.read_bytes()[:entry.stat().st_size // 2])
    second = start()
    assert second["hits"] == 0 and len(second["warnings"]) == 1, second
    assert "Error reading persistent compilation cache entry" in second["warnings"][0]
    assert start() == {"hits": 1, "warnings": []}


def test_the_cache_folder_is_gdn_jax_cache_dir_else_xdg_cache_home_else_home(tmp_path):
    """The folder README and `--compilation-cache` name: $GDN_JAX_CACHE_DIR ("off": none), else
    $XDG_CACHE_HOME/gdn_jax/jax, else ~/.cache/gdn_jax/jax."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("GDN_JAX_CACHE_DIR", "XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR")}
    code = "from gdn_jax.worker.compile_cache import enable_compilation_cache; print(enable_compilation_cache())"

    def folder(**env):
        done = subprocess.run([sys.executable, "-c", code], env={**base, "JAX_PLATFORMS": "cpu", **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert folder(HOME=str(tmp_path)) == str(tmp_path / ".cache" / "gdn_jax" / "jax")
    assert folder(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "xdg")) == str(tmp_path / "xdg" / "gdn_jax" / "jax")
    assert folder(XDG_CACHE_HOME=str(tmp_path / "xdg"), GDN_JAX_CACHE_DIR=str(tmp_path / "own")) == str(tmp_path / "own")
    assert folder(XDG_CACHE_HOME=str(tmp_path / "xdg"), GDN_JAX_CACHE_DIR="off") == "None"


START = """
import json, sys
from gdn_jax import LLM, SamplingParams
llm = LLM("tiny-random", verbose=False, max_num_seqs=1, max_model_len=64, chunk_stride=16, max_num_batched_tokens=16)
llm.engine.warm_up()
out = llm.generate([[5, 6, 7], list(range(10, 40))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"stats": llm.engine.worker.warm_up_stats, "tokens": [o.outputs[0].token_ids for o in out]}))
"""


@pytest.mark.slow  # three processes, ~25 s
def test_a_store_refilled_while_jax_cache_holds_the_programs_serves_the_next_process(tmp_path):
    """Process starts on one cache folder: the first fills JAX's cache and the store; the store is then lost (an
    eviction, a corrupt entry, another source version) while JAX's cache still holds every program; the second start
    refills the store; the third loads it and must generate the same tokens. The second start used to store copies
    of JAX's cache loads (turning JAX's flag off alone did not stop them in such a process), and the third failed at
    its first call: "Function ... not found"."""
    import json
    import shutil
    import subprocess
    import sys

    env = own_cache_env(GDN_JAX_CACHE_DIR=str(tmp_path))

    def start():
        r = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = start()
    assert first["stats"]["loaded"] == 0
    shutil.rmtree(tmp_path / "executables")
    refilled = start()
    assert refilled["stats"] == first["stats"] and refilled["tokens"] == first["tokens"]
    third = start()
    assert third["stats"]["compiled"] == 0 and third["tokens"] == first["tokens"]
