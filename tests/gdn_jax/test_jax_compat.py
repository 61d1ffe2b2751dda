"""JAX's private APIs (gdn_jax.jax_compat): the locked JAX takes each private path, and each public fallback, forced
on by turning its flag off, still does the job: compilations counted, settings keyed, CPU kinds kept apart, a
damaged cache entry heard of (or, without the private read, a miss as JAX makes it)."""

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from gdn_jax import jax_compat
from gdn_jax.backends.cpu import library
from gdn_jax.worker import executable_store as executables

PATHS = pytest.mark.parametrize("private", [True, False], ids=["private", "public"])


def test_the_locked_jax_takes_every_private_path():
    """A JAX outside VERIFIED_JAX runs the fallbacks: check the private APIs on it, then widen VERIFIED_JAX."""
    assert jax_compat.verified(), f"JAX {jax.__version__} is outside {jax_compat.VERIFIED_JAX}"
    assert jax_compat.CACHE_KEY_HOOK and jax_compat.TRACE_CONTEXT_NAMES and jax_compat.JIT_CACHE_SIZE
    assert jax_compat.CACHE_READ
    assert jax_compat.jax_version("0.10.2") == (0, 10) and jax_compat.jax_version("1.2.3.dev20260101") == (1, 2)
    assert not jax_compat.verified("0.9.2") and not jax_compat.verified("0.11.0")


@PATHS
def test_compilations_count_a_new_compile_and_not_a_cached_call(monkeypatch, private):
    monkeypatch.setattr(jax_compat, "JIT_CACHE_SIZE", private and jax_compat.JIT_CACHE_SIZE)
    f = jax.jit(lambda x: x * 3.0 + 1.0)  # host arrays below: no other program compiles on the way
    stand_in = object()  # not jitted: counts none
    start = jax_compat.compilations([f, stand_in])
    f(np.ones(3, np.float32))
    assert jax_compat.compilations([f, stand_in]) == start + 1
    f(np.zeros(3, np.float32))  # cached
    assert jax_compat.compilations([f, stand_in]) == start + 1
    f(np.ones(4, np.float32))  # a new shape
    assert jax_compat.compilations([f, stand_in]) == start + 2
    if not private:  # the public count is this thread's
        thread = threading.Thread(target=lambda: jax.jit(lambda x: x - 2.0)(np.ones(3, np.float32)))
        thread.start()
        thread.join()
        assert jax_compat.compilations([f]) == start + 2


@PATHS
def test_the_store_key_changes_with_a_jax_setting_that_changes_the_program(monkeypatch, private):
    monkeypatch.setattr(jax_compat, "TRACE_CONTEXT_NAMES", private and jax_compat.TRACE_CONTEXT_NAMES)
    names = jax_compat.trace_settings()
    assert (names != jax_compat.PUBLIC_TRACE_SETTINGS) == private
    assert set(jax_compat.PUBLIC_TRACE_SETTINGS) <= set(names) & set(jax.config.values)
    args = (jnp.zeros((2, 3)),)
    key = executables.executable_key("step", ("cfg", 64), args, None)
    others = []
    for name, value in (("jax_default_matmul_precision", "highest"), ("jax_threefry_partitionable", None),
                        ("jax_numpy_rank_promotion", "raise")):
        before = jax.config.values[name]
        jax.config.update(name, (not before) if value is None else value)
        try:
            others.append(executables.executable_key("step", ("cfg", 64), args, None))
        finally:
            jax.config.update(name, before)
    assert executables.executable_key("step", ("cfg", 64), args, None) == key
    assert len({key, *others}) == 4


@contextlib.contextmanager
def persistent_cache(folder: str):
    """JAX's persistent compilation cache in `folder`, every compilation kept (as it was, after)."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: jax.config.values[name] for name in names}
    for name, value in zip(names, (folder, 0.0, 0)):
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@PATHS
def test_two_kinds_of_cpu_sharing_a_cache_folder_keep_their_entries_apart(tmp_path, monkeypatch, private):
    """With JAX's key hook, the host CPU is in each entry's key (after what a hook set before adds); without it, each
    CPU kind has its own subfolder. Either way a start on one kind finds its own entry, never the other kind's."""
    if private:
        monkeypatch.setattr(jax_compat._cache_key, "custom_hook", lambda: "set-before;")  # (put back afterwards)
    else:
        monkeypatch.setattr(jax_compat, "CACHE_KEY_HOOK", False)
    monkeypatch.setattr(executables, "_jax_key_tagged", False)
    hits = []
    listener = lambda event, **kwargs: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    jax.monitoring.register_event_listener(listener)

    def start(tag: str) -> tuple[str, set]:
        monkeypatch.setattr(library, "host_cpu_tag", lambda: tag)
        folder = executables.jax_cache_folder(str(tmp_path))
        with persistent_cache(folder):
            jax.jit(lambda x: x * 5.0 - 1.0)(np.ones(3, np.float32))  # a fresh function: traced and looked up
        return folder, {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*-cache")}

    try:
        folder_a, first = start("x86_64-aaaaaaaaaaaa")
        folder_b, both = start("x86_64-bbbbbbbbbbbb")
        assert len(first) == 1 and len(both) == 2 and not hits
        assert start("x86_64-aaaaaaaaaaaa") == (folder_a, both) and len(hits) == 1
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert executables.tag_jax_cache_keys() == private
    if private:
        assert folder_a == folder_b == str(tmp_path)
        assert jax_compat._cache_key.custom_hook() == "set-before;host_cpu=x86_64-aaaaaaaaaaaa"
    else:
        assert folder_a == str(tmp_path / "host-x86_64-aaaaaaaaaaaa") != folder_b


@PATHS
def test_a_cache_entry_that_does_not_load_is_heard_of_by_its_key(tmp_path, monkeypatch, private):
    """JAX warns and compiles either way; with the private read, the entry's key is heard of first."""
    monkeypatch.setattr(jax_compat, "CACHE_READ", private and jax_compat.CACHE_READ)
    module = jax_compat._compilation_cache
    if module is not None:  # (the read is put back afterwards)
        monkeypatch.setattr(module, "get_executable_and_time", module.get_executable_and_time)
    heard = []
    assert jax_compat.on_damaged_cache_entry(heard.append) == private
    with persistent_cache(str(tmp_path)):
        jax.jit(lambda x: x * 7.0 + 2.0)(np.ones(3, np.float32))
        (entry,) = tmp_path.glob("*-cache")
        entry.write_bytes(entry.read_bytes()[:entry.stat().st_size // 2])
        with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry"):
            jax.jit(lambda x: x * 7.0 + 2.0)(np.ones(3, np.float32))  # a fresh function: traced and looked up
    assert heard == ([entry.name.removesuffix("-cache")] if private else [])
