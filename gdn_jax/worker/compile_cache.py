"""JAX's persistent compilation cache: its folder, its bound, turning it on, and deleting its damaged entries."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax

from gdn_jax import envs, jax_compat
from gdn_jax.worker.executable_store import jax_cache_folder, tag_jax_cache_keys

# Default bound of the folder: a step shape's entry is 70-250 KB, Qwen3.5-9B's whole warm-up grid ~10 MB, so this
# holds about two hundred such grids before the least recently used entries go. The executable store beside JAX's
# entries (~56 MB per 9B grid) is held to the same bound on its own, so the folder takes at most twice this.
CACHE_MAX_MB = 2048


def compilation_cache_max_bytes() -> int:
    """The cache's bound in bytes: `$GDN_JAX_CACHE_MAX_MB` MiB (default CACHE_MAX_MB; -1: no bound, the folder only
    grows)."""
    text = envs.get("GDN_JAX_CACHE_MAX_MB")
    if not text:
        return CACHE_MAX_MB << 20
    try:
        mb = int(text)
    except ValueError:
        mb = 0
    if mb < 1 and mb != -1:
        raise ValueError(f"GDN_JAX_CACHE_MAX_MB must be a positive whole number of MiB, or -1 for no bound; "
                         f"got {text!r}")
    return -1 if mb == -1 else mb << 20


def _stamp_entries(folder: str) -> None:
    """Gives every entry of JAX's cache folder (`<key>-cache`) the access stamp its eviction reads (`<key>-atime`,
    nanoseconds, little-endian) where it has none: entries written while eviction was off (by an older version, or
    with the bound off) carry none, and JAX's eviction fails on them. The stamp is the entry's modification time, so
    such entries go first."""
    try:
        for entry in Path(folder).glob("*-cache"):
            stamp = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
            if not stamp.exists():
                stamp.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
    except OSError:  # a read-only or vanishing folder: JAX's own reads and writes will say so, or miss
        pass


_engine_folder: str | None = None  # the folder `enable_compilation_cache` last put JAX's cache in, or kept
_hearing_damage = False  # whether `_delete_damaged` hears of the entries that do not load


def _delete_damaged(key: str) -> None:
    """Deletes the entry `key` of JAX's cache, which did not load, where the cache is in the engine's folder: JAX
    warns and compiles the program, then writes the entry anew (it never replaces an entry that is there), so that a
    damaged entry is said at one start, not at every one."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or folder != _engine_folder:
        return
    for suffix in ("-cache", "-atime"):  # the entry first: JAX's eviction reads the stamp of each entry it finds
        with contextlib.suppress(OSError):  # a read-only folder: JAX says so at every start, as before
            os.unlink(os.path.join(folder, key + suffix))


def default_cache_dir() -> str | None:
    """The folder the cache uses unless one is given: `$GDN_JAX_CACHE_DIR` (None for "off"), else
    `$XDG_CACHE_HOME/gdn_jax/jax`, else `~/.cache/gdn_jax/jax`."""
    folder = envs.get("GDN_JAX_CACHE_DIR")
    if folder == "off":
        return None
    if folder:
        return folder
    base = envs.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gdn_jax", "jax")


def enable_compilation_cache(folder: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache in `folder` ("" or "off": no cache; None: `default_cache_dir()`),
    so that a second process start reuses compiled steps; a folder already configured (jax_compilation_cache_dir)
    is kept. The folder is bounded (`compilation_cache_max_bytes`): past the bound JAX deletes the least recently
    used entries (a folder this process cannot write is read as it is, unbounded). On the CPU its entries are keyed
    by the host's CPU too (`executable_store.tag_jax_cache_keys`; where JAX cannot, they go to a subfolder per CPU
    kind: `executable_store.jax_cache_folder`), so that machines of two kinds can share the folder. An entry there
    that does not load (truncated, garbled) is deleted when JAX reads it (`_delete_damaged`; where this JAX allows,
    `jax_compat.on_damaged_cache_entry`), and written again. Returns the folder in use."""
    global _engine_folder, _hearing_damage
    tag_jax_cache_keys()
    if not _hearing_damage:
        _hearing_damage = jax_compat.on_damaged_cache_entry(_delete_damaged)
    current = jax.config.jax_compilation_cache_dir
    if current:
        _engine_folder = current
        return current
    folder = default_cache_dir() if folder is None else folder if folder not in ("", "off") else None
    if folder is None:
        return None
    max_bytes = compilation_cache_max_bytes()
    if os.path.exists(folder) and not os.path.isdir(folder):  # JAX would warn and compile everything every start
        raise ValueError(f"the compilation cache folder {folder} (GDN_JAX_CACHE_DIR, gdn-jax --compilation-cache) "
                         f"is a file, not a folder")
    folder = jax_cache_folder(folder)
    if max_bytes != -1 and os.path.isdir(folder) and not os.access(folder, os.W_OK):
        max_bytes = -1  # a read-only (shared, prefilled) folder: eviction's lock file could not be written, every
        # read would fail, and nothing is written there anyway
    if max_bytes != -1:
        _stamp_entries(folder)
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    jax.config.update("jax_compilation_cache_dir", folder)
    # every executable is kept, the quick ones too: a second start then compiles nothing
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _engine_folder = folder
    return folder
