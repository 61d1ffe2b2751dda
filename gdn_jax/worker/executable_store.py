"""Compiled step executables kept on disk under a key computed without tracing, so that a second process start loads
its warm-up executables without lowering them first.

JAX's persistent compilation cache keys an executable by its lowered module: a second start still traces and lowers
every shape (0.3-1.5 s each for Qwen3.5-9B's step, most of a second start's warm-up) before it can look the
executable up. This store keys it by what determines the module instead: the source of the package (every
`gdn_jax` and `scheduler` file, so any code change misses), the jax and jaxlib versions, the backend and device (on
the CPU, the host's CPU kind: `host_cpu`), the compile options, the static context the caller passes (model config, GDN chunk size and schedule), the environment
that changes a compiled program (`ENVIRONMENT`), JAX's settings that do (`jax_settings`: the default matmul
precision, how random bits are drawn, ...) and the tree structure, shapes and dtypes of the arguments. A hit is
`jax.experimental.serialize_executable`'s payload, loaded as a `jax.stages.Compiled` (its argument donation included).
A corrupt or unreadable entry is a miss (an entry holds its digest); a write that fails leaves no entry; either says
so once (a RuntimeWarning), and the engine compiles.

The folder is `executables/<version>/` beside JAX's persistent cache (compile_cache.enable_compilation_cache; off when
that is off), one subfolder per source digest: every edit of the package writes a new set (~56 MB for Qwen3.5-9B's
warm-up grid), so only the `KEEP_VERSIONS` most recently used sets are kept. Within them the store is bounded like
JAX's cache (the same `jax_compilation_cache_max_size`, compile_cache.compilation_cache_max_bytes): every model
geometry adds a set of entries, and past the bound a save deletes the least recently used ones (a load marks an entry
used).

A loaded executable can still fail when called: on the CPU, XLA resolves each kernel of an executable when it first
runs it, and a stored copy can lack one ("NOT_FOUND: Function convert_bitcast_fusion.3 not found"), which shows only
when a call takes the path that needs it: one compiled in a process that had loaded the same program from JAX's
persistent cache does (`fresh_compilation`; `make test` ran into it, and tests/gdn_jax/test_executables.py shows it). The worker
then deletes the entries the failed step called (`discard`; the error, raised when a result is read, does not say
which call failed), compiles those shapes again, and recomputes the step (`StaleExecutable`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import pickle
import re
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from gdn_jax import diagnostics, envs, jax_compat
from gdn_jax.backends.cpu import library
from gdn_jax.model.forms import GENERIC, Forms


# environment that changes a compiled step
ENVIRONMENT = envs.COMPILE_AFFECTING


def jax_settings() -> list[tuple[str, str]]:
    """The JAX settings a traced program depends on, as (name, repr): those JAX's own trace cache keys by
    (`jax_compat.trace_settings`: the default matmul precision, how random bits are drawn, 64-bit types, promotion
    rules, ...), and the default PRNG implementation."""
    values = jax.config.values
    names = dict.fromkeys([*jax_compat.trace_settings(), "jax_default_prng_impl"])
    return [(name, repr(values[name])) for name in names if name in values]


_jax_key_tagged = False


def tag_jax_cache_keys() -> bool:
    """Adds `host_cpu` to the key of every entry JAX's persistent compilation cache writes or reads in this process
    while the default backend is the CPU (JAX's key holds the backend's name and version, not the CPU's), after what
    a hook set before adds (`jax_compat.add_to_cache_key`). Once per process; False where this JAX cannot."""
    global _jax_key_tagged
    if not _jax_key_tagged:
        _jax_key_tagged = jax_compat.add_to_cache_key(
            lambda: f"host_cpu={library.host_cpu_tag()}" if jax.default_backend() == "cpu" else "")
    return _jax_key_tagged


def jax_cache_folder(folder: str) -> str:
    """The folder JAX's persistent cache uses for `folder`: itself where `tag_jax_cache_keys` keys the entries by
    `host_cpu`, else on the CPU its subfolder `host-<host_cpu>`, so that two kinds of machine sharing it stay apart."""
    if tag_jax_cache_keys() or jax.default_backend() != "cpu":
        return folder
    return os.path.join(folder, f"host-{library.host_cpu_tag()}")


@functools.cache
def source_digest() -> str:
    """Digest of the package's source (gdn_jax and scheduler: Python and the CPU kernels' C++, headers included: a
    stored step calls the kernels the current source builds) and the jax / jaxlib versions."""
    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    root = Path(__file__).resolve().parents[2]
    for pkg in ("gdn_jax", "scheduler"):
        for path in sorted(p for ext in ("*.py", "*.cc", "*.h") for p in (root / pkg).rglob(ext)):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


KEEP_VERSIONS = 3  # sets of executables (source versions) kept in the store
STALE_PARTIAL_S = 3600  # a partial write (`save`'s `.tmp` file) untouched this long is left by a process that died


def default_folder(cache: str | None = None) -> str | None:
    """`executables/<source version>/` in `cache`, by default JAX's persistent compilation cache folder (None when
    that cache is off, or GDN_JAX_EXECUTABLE_STORE is 0). Marks this version as used now and deletes all but the
    KEEP_VERSIONS most recently used ones (and any entry of the former flat layout), and in those kept, the partial
    writes older than STALE_PARTIAL_S: a process killed while saving (SIGKILL, a power loss) leaves its `.tmp` file,
    which no bound counts and nothing else deletes; a younger one may be another process's save in progress."""
    cache = cache or jax.config.jax_compilation_cache_dir
    if not cache or envs.get("GDN_JAX_EXECUTABLE_STORE") == "0":
        return None
    root = Path(cache, "executables")
    folder = root / source_digest()[:16]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.utime(folder)
        others = sorted((p for p in root.iterdir() if p != folder), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in [p for p in others if not p.is_dir()] + [p for p in others if p.is_dir()][KEEP_VERSIONS - 1:]:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        cutoff = time.time() - STALE_PARTIAL_S
        for partial in (p for d in root.iterdir() if d.is_dir() for p in d.iterdir() if p.name.endswith(".tmp")):
            with contextlib.suppress(OSError):  # (gone already: another process deleting or renaming it)
                if partial.stat().st_mtime < cutoff:
                    partial.unlink()
    except OSError:  # a read-only or vanished cache folder: the store misses and saving fails (`save` says so)
        pass
    return str(folder)


def executable_key(kind: str, static, args, options: dict | None, forms: Forms = GENERIC) -> str:
    """The store's key of `kind` (e.g. "step") compiled with `options` for `args` (arrays or ShapeDtypeStructs, any
    pytree) under `static` (whatever else the traced function closes over, as a repr-able value), traced in
    `forms`."""
    leaves, treedef = jax.tree.flatten(args)
    spec = [(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))) for x in leaves]
    device = jax.devices()[0]
    # what changes the compiled program from outside the arguments: XLA's flags, the layer-loop switch, JAX's
    # settings (precision, random bits, ...); and the runtime it was compiled for (the device's kind, the backend's
    # version: a GPU's CUDA and driver)
    env = [(name, envs.get(name) or None) for name in ENVIRONMENT] + jax_settings() + machine_choices(forms)
    if device.platform == "cpu":
        env.append(("host_cpu", library.host_cpu_tag()))  # the machine code is this CPU's (`host_cpu`)
    text = repr((source_digest(), kind, static, str(treedef), spec, sorted((options or {}).items()),
                 device.platform, device.device_kind, device.client.platform_version, jax.device_count(), env))
    return hashlib.sha256(text.encode()).hexdigest()


def machine_choices(forms: Forms) -> list[tuple[str, object]]:
    """The forms a step is traced in, as (name, value) pairs: what this machine built or measured once
    (`tuning.resolve_forms`: whether the kernels are there, the forms of its products, its decode steps' vector
    width) and the environment's settings of the trace."""
    return [(field.name, getattr(forms, field.name)) for field in dataclasses.fields(forms)]


DIGEST = 32  # an entry starts with the SHA-256 of the rest (`save`)
_said: set[str] = set()  # what `_say` has said in this process


def _say(what: str, message: str) -> None:
    """Warns `message` once per process for `what` (a folder that cannot be read or written, a damaged entry): the
    store's failures are misses, the engine compiles instead, and this says why a start compiled what it could have
    loaded. At the user's line, from warm-up's loading threads too (`diagnostics.map_on_threads`)."""
    if what in _said:
        return
    _said.add(what)
    diagnostics.warn(message)


def load(folder: str | None, key: str):
    """The `jax.stages.Compiled` stored under `key`, or None (no folder, no entry, one whose digest does not match,
    or one that does not load). A hit is marked used (its modification time: what `evict` orders by)."""
    if not folder:
        return None
    path = Path(folder, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # no entry (or deleted since: another process evicting it)
        return None
    except OSError as exc:  # a folder this user may not enter (another user's, mode 700)
        _say(f"read {folder}", f"the executable store {folder} cannot be read ({exc}): what it holds is compiled "
                                f"again")
        return None
    try:
        if hashlib.sha256(data[DIGEST:]).digest() != data[:DIGEST]:  # damaged (see `save`)
            raise ValueError("its digest does not match its content")
        compiled = serialize_executable.deserialize_and_load(*pickle.loads(data[DIGEST:]))
    except Exception as exc:  # noqa: BLE001 - a damaged entry is a miss: the caller compiles (and replaces it)
        _say(str(path), f"the executable store's entry {path} does not load ({exc}): compiled again")
        return None
    with contextlib.suppress(OSError):
        os.utime(path)
    return compiled


class StaleExecutable(RuntimeError):
    """A step that called stored executables failed with a missing function (`missing_function`): they have been
    deleted from the store and from the worker; the step's donated state may be lost."""


def missing_function(exc: BaseException) -> bool:
    """Whether `exc` is XLA's failure to find one of an executable's own kernels when it runs it."""
    text = str(exc)  # "NOT_FOUND: Function f not found (type id: 1)", "INTERNAL: Error dispatching computation: ..."
    return isinstance(exc, jax.errors.JaxRuntimeError) and re.search(r"Function \S+ not found \(type id", text) is not None


BAD = ".bad"  # an empty file `<key>.bad`: that key's executable failed once; it is compiled, not stored, from then on


def discard(folder: str | None, key: str) -> None:
    """Deletes the entry `key` (a bad executable) and marks the key (`BAD`): later starts compile it and do not store
    it again (in the process where it happened, each new compilation of that shape was stored lacking the same
    kernel)."""
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, key).unlink()
        with contextlib.suppress(OSError):
            Path(folder, key + BAD).touch()


def _entries(folder: str) -> list[Path]:
    """The store's entries that share `folder`'s bound: those of every source version when `folder` is a version
    folder of the store (`executables/<version>`), else those of `folder` alone (partial writes excluded)."""
    root = Path(folder)
    dirs = [d for d in root.parent.iterdir() if d.is_dir()] if root.parent.name == "executables" else [root]
    return [p for d in dirs for p in d.iterdir() if p.is_file() and not p.name.endswith((".tmp", BAD))]


def evict(folder: str, max_bytes: int, keep: str | None = None) -> int:
    """Deletes the least recently used entries (`_entries`) until they take at most `max_bytes` (-1: no bound),
    never the entry `keep`. Returns how many were deleted."""
    if max_bytes == -1:
        return 0
    try:
        stats = [(p.stat(), p) for p in _entries(folder)]
    except OSError:  # a vanishing folder or entry (another process evicting): the next save tries again
        return 0
    total, deleted = sum(st.st_size for st, _ in stats), 0
    for st, path in sorted(stats, key=lambda e: e[0].st_mtime_ns):
        size = st.st_size
        if total <= max_bytes:
            break
        if keep is not None and path == Path(folder, keep):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            total, deleted = total - size, deleted + 1
    return deleted


@contextlib.contextmanager
def fresh_compilation():
    """JAX's persistent compilation cache off inside (and as it was after): for compilations whose executables the
    store saves. On the CPU an executable JAX loaded from that cache cannot be serialized again (the copy loads, then
    fails at its first call: "Function ... not found"), and that cache's key leaves out what the store's key holds
    (the source digest): after an edit that leaves the compiled program as it was, warm-up would load it from JAX's
    cache and store a copy that fails on the next start.

    The flag alone did not stop every load: a process that had compiled with the cache on still loaded warm-up's
    programs from it (JAX keeps whether its cache is in use once checked), and the store saved those copies. The
    cache is also reset on the way in and out, so that JAX reads the flag anew both times
    (tests/gdn_jax/test_executables.py runs the processes that showed it).

    What this cannot prevent: in a process that has loaded a program from JAX's cache, a fresh compilation of the same
    program runs, but its serialized copy lacks kernels (compiled anew, not a load: JAX logs no cache hit). The worker
    finds such a copy on the next start, when a step fails in it (`missing_function`), and recomputes."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def save(folder: str | None, key: str, compiled, max_bytes: int | None = None) -> bool:
    """Stores `compiled` under `key` (atomically: a concurrent reader sees the whole entry or none), then keeps the
    store within `max_bytes` (`evict`; default: JAX's cache bound, `jax_compilation_cache_max_size`). The entry
    starts with its payload's digest, which `load` checks: XLA does not check an executable it deserializes, and a
    damaged one loaded and computed wrong values, or aborted the process (in the load or at its first call)."""
    if not folder:
        return False
    partial = None
    try:
        if Path(folder, key + BAD).exists():
            return False
        os.makedirs(folder, exist_ok=True)
        payload = pickle.dumps(serialize_executable.serialize(compiled))
        with tempfile.NamedTemporaryFile(dir=folder, delete=False, suffix=".tmp") as f:
            partial = f.name
            f.write(hashlib.sha256(payload).digest() + payload)
        os.replace(partial, os.path.join(folder, key))
        partial = None
    except (OSError, ValueError, TypeError, pickle.PicklingError) as exc:
        if isinstance(exc, OSError):  # the folder, not this executable
            _say(folder, f"the executable store {folder} cannot be written ({exc}): what warm-up compiles is not "
                         f"kept, a later start compiles it again")
        return False
    finally:
        if partial:  # (a full disk, an interrupt: no eviction counts or deletes a partial file)
            with contextlib.suppress(OSError):
                os.unlink(partial)
    evict(folder, jax.config.jax_compilation_cache_max_size if max_bytes is None else max_bytes, keep=key)
    return True
