"""JAX's private APIs, the only module that reaches them: each behind a feature test, with a public fallback.

A private API is used only on the JAX versions it was checked against (`VERIFIED_JAX`) and where it is there; its
flag below says so, and each function falls back to public behaviour when the flag is off:

- `CACHE_KEY_HOOK` (`jax._src.cache_key.custom_hook`): `add_to_cache_key` adds a string to every key of JAX's
  persistent compilation cache; without it nothing is added and the function says so (False).
- `TRACE_CONTEXT_NAMES` (`jax._src.config.trace_context_names`): `trace_settings` names the JAX settings a traced
  program depends on; without it, the fixed list `PUBLIC_TRACE_SETTINGS` of `jax.config` settings.
- `JIT_CACHE_SIZE` (a jitted function's `_cache_size()`): `compilations` counts the executables some jitted
  functions hold; without it, the compilations on this thread, from `jax.monitoring`'s backend-compile events.
- `CACHE_READ` (`jax._src.compilation_cache.get_executable_and_time`, which JAX's compiler calls to read an entry of
  its persistent cache): `on_damaged_cache_entry` hears of an entry that does not load; without it, of none.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable

import jax

VERIFIED_JAX = ((0, 10), (0, 10))  # the JAX versions (major, minor), first and last, the private APIs were checked on


def jax_version(version: str = jax.__version__) -> tuple[int, int]:
    """`version`'s (major, minor)."""
    major, minor = (int(n) for n in re.findall(r"\d+", version)[:2])
    return major, minor


def verified(version: str = jax.__version__) -> bool:
    """Whether `version` of JAX is one the private APIs were checked on."""
    return VERIFIED_JAX[0] <= jax_version(version) <= VERIFIED_JAX[1]


def _cache_key_module():
    try:
        from jax._src import cache_key
    except ImportError:
        return None
    return cache_key if callable(getattr(cache_key, "custom_hook", None)) else None


def _trace_context_names() -> tuple[str, ...] | None:
    try:
        from jax._src.config import trace_context_names
        names = trace_context_names() if callable(trace_context_names) else trace_context_names
        names = tuple(names)
    except Exception:  # absent, or present but unsupported by this jaxlib (NotImplementedError)
        return None
    return names if all(isinstance(n, str) for n in names) else None


def _compilation_cache_module():
    try:
        from jax._src import compilation_cache
    except ImportError:
        return None
    return compilation_cache if callable(getattr(compilation_cache, "get_executable_and_time", None)) else None


_cache_key = _cache_key_module() if verified() else None
_compilation_cache = _compilation_cache_module() if verified() else None
CACHE_READ = _compilation_cache is not None
CACHE_KEY_HOOK = _cache_key is not None
TRACE_CONTEXT_NAMES = verified() and _trace_context_names() is not None
JIT_CACHE_SIZE = verified() and callable(getattr(jax.jit(lambda: None), "_cache_size", None))


def add_to_cache_key(text: Callable[[], str]) -> bool:
    """Appends `text()` to the key of every entry JAX's persistent compilation cache writes or reads from now on,
    after what a hook set before adds; False, and nothing changed, where this JAX has no such hook."""
    if not CACHE_KEY_HOOK:
        return False
    before = _cache_key.custom_hook
    _cache_key.custom_hook = lambda: before() + text()
    return True


def on_damaged_cache_entry(damaged: Callable[[str], None]) -> bool:
    """Calls `damaged(key)` whenever an entry `key` of JAX's persistent compilation cache is read but does not load
    (it does not decompress or deserialize), before JAX warns and compiles the program as for a miss; False, and
    nothing changed, where this JAX has no such read (`CACHE_READ`). A file that cannot be read (OSError: a folder
    of another user, a lock that timed out) is not a damaged entry."""
    if not CACHE_READ:
        return False
    read = _compilation_cache.get_executable_and_time

    def checked_read(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except (OSError, MemoryError):
            raise
        except Exception:
            damaged(cache_key)
            raise

    _compilation_cache.get_executable_and_time = checked_read
    return True


# The settings known to change an inference step, all in JAX's trace context where JAX lists it.
PUBLIC_TRACE_SETTINGS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_threefry_partitionable",
                         "jax_random_seed_offset", "jax_high_dynamic_range_gumbel", "jax_numpy_dtype_promotion",
                         "jax_numpy_rank_promotion")


def trace_settings() -> tuple[str, ...]:
    """The names of the JAX settings a traced program depends on (JAX's trace context), else PUBLIC_TRACE_SETTINGS."""
    names = _trace_context_names() if TRACE_CONTEXT_NAMES else None
    return PUBLIC_TRACE_SETTINGS if names is None else names


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event of each XLA compile
_this_thread = threading.local()  # .count: backend compilations on this thread since `_count_compile` listens
_listen_lock = threading.Lock()
_listening = False


def _count_compile(event: str, duration_secs: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _this_thread.count = getattr(_this_thread, "count", 0) + 1


def compilations(jitted: Iterable) -> int:
    """A count that grows by one per executable the jitted functions `jitted` compile or load from JAX's persistent
    cache (objects that are not jitted count none); without `JIT_CACHE_SIZE`, every function's on this thread."""
    global _listening
    if JIT_CACHE_SIZE:
        return sum(f._cache_size() for f in jitted if hasattr(f, "_cache_size"))
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_count_compile)
            _listening = True
    return getattr(_this_thread, "count", 0)
