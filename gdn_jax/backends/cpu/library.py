"""Building and loading the compiled CPU kernels: one library per set of sources, jaxlib, compiler and CPU, built on
first use with the system's C++ compiler and registered with XLA once per process.

A library is written under a temporary name and renamed into place, its SHA-256 written beside it first
(`<library>.sha256`), and checked before every load: loading a truncated library (a disk quota in a shared home
folder) ended the process with a bus error, a garbled one with a segmentation fault, at every start. A library that
does not match its digest, has none, cannot be read or does not load is deleted and built again, once (`load`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib

from gdn_jax import envs
from gdn_jax.diagnostics import user_stacklevel

KERNELS_ENV = "GDN_JAX_CPU_KERNELS"  # "0": never, "1": required, unset: when it builds
TARGET = "gdn_jax_gdn_decode"
PREFILL_TARGET = "gdn_jax_gdn_prefill"
ATTENTION_TARGET = "gdn_jax_attention_decode"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
ROWS_TARGET = "gdn_jax_rows_product"
# (and their headers, parallel.h and lanes.h)
SOURCES = ("gdn_decode.cc", "gdn_prefill.cc", "attention_decode.cc", "rows_product.cc")
MAX_DIM = 256  # the kernels' largest head dimension (their per-head buffers)
MAX_GROUP = 16  # attention: the most query heads per KV head
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
LAYOUT = "digest beside"  # in the library's key: libraries built before there was a digest are not looked at
DIGEST_SUFFIX = ".sha256"  # beside a library: the SHA-256 of its bytes, in hex


# /proc/cpuinfo fields that name the CPU and its instruction sets (x86: vendor, family, model, flags; Arm: implementer,
# part, features; RISC-V: isa), not those that differ from core to core or over time (clock, core ids)
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer", "CPU architecture",
              "CPU variant", "CPU part", "Features", "isa", "uarch")


def host_cpu(cpuinfo: str | None = None) -> str:
    """What XLA's CPU backend compiles for on this machine, as a short tag: the architecture and a digest of the CPU's
    model and instruction-set flags (Linux's /proc/cpuinfo, first processor; elsewhere what `platform` reports).

    XLA compiles CPU code for the host's own features and refuses to load an executable compiled with a feature the
    host lacks, while a host with more features loads it and runs code tuned for the other CPU (without its wider
    vectors, say). So a cache folder shared by two kinds of machine (a home folder on a cluster) must keep their
    executables apart: without the tag each start on one kind replaced the other's entries, or ran them."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    first = cpuinfo.strip().split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): " ".join(sorted(v.split())) if k.strip() in ("flags", "Features") else v.strip()
              for k, v in fields.items()}
    named = [(k, fields[k]) for k in CPU_FIELDS if k in fields]
    text = repr(named) if named else repr((platform.system(), platform.processor()))
    return f"{platform.machine() or 'cpu'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@functools.cache
def host_cpu_tag() -> str:
    """`host_cpu()` of this machine, read once."""
    return host_cpu()


def _setting() -> str:
    return envs.get(KERNELS_ENV)


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: `$CXX` if set (it must exist), else c++, g++ or clang++."""
    if envs.get("CXX"):
        return shutil.which(envs.get("CXX"))
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def folder() -> Path:
    """Where built kernels are kept: `kernels/` in JAX's persistent cache folder, else in a per-user folder under the
    system's temporary folder."""
    cache = jax.config.jax_compilation_cache_dir
    base = Path(cache) if cache else Path(tempfile.gettempdir(), f"gdn-jax-{os.getuid()}")
    return base / "kernels"


def library_path(cxx: str, out_folder: Path) -> Path:
    """Where the kernel library for these sources, jaxlib, compiler (`cxx`) and CPU is kept in `out_folder`."""
    texts = [path.read_bytes() for path in sorted(SOURCE_DIR.iterdir()) if path.suffix in (".cc", ".h")]
    key = hashlib.sha256(b"\0".join([*texts, jaxlib.__version__.encode(), cxx.encode(), host_cpu().encode(),
                                     " ".join(FLAGS).encode(), LAYOUT.encode()])).hexdigest()[:16]
    return out_folder / f"gdn_jax_kernels-{key}.so"


def digest_path(lib: Path) -> Path:
    """The file beside the library `lib` that holds its digest."""
    return lib.with_name(lib.name + DIGEST_SUFFIX)


def build(cxx: str, out_folder: Path) -> Path:
    """The kernel library for these sources, jaxlib, compiler and CPU, built into `out_folder` unless it is there.
    Each source compiles in a process of its own, all at once (most of the time is the FFI headers), then one
    link. The library's digest is renamed into place before the library: a process that finds the library finds
    its digest, and never a library half-written."""
    lib = library_path(cxx, out_folder)
    if lib.exists():
        return lib
    out_folder.mkdir(parents=True, exist_ok=True)
    # one folder per build under way (objects and the library before its rename), gone whatever happens
    with tempfile.TemporaryDirectory(prefix=f".{lib.name}.", dir=out_folder) as work:
        objects = [str(Path(work, Path(name).stem + ".o")) for name in SOURCES]
        compile_flags = [flag for flag in FLAGS if flag != "-shared"]
        jobs = [subprocess.Popen([cxx, *compile_flags, f"-I{jax.ffi.include_dir()}", "-c", str(SOURCE_DIR / name),
                                  "-o", obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for name, obj in zip(SOURCES, objects)]
        try:
            errors = [job.communicate(timeout=300)[1] for job in jobs]
        finally:
            for job in jobs:  # after a timeout (or an interrupt) no compiler is left running
                if job.poll() is None:
                    job.kill()
                    job.wait()
        for job, err in zip(jobs, errors):
            _succeeded(cxx, job.returncode, err)
        tmp = Path(work, lib.name)
        link = subprocess.run([cxx, *FLAGS, *objects, "-o", str(tmp)], capture_output=True, text=True, timeout=300)
        _succeeded(cxx, link.returncode, link.stderr)
        digest = Path(work, digest_path(lib).name)
        digest.write_text(hashlib.sha256(tmp.read_bytes()).hexdigest() + "\n")
        os.replace(digest, digest_path(lib))
        os.replace(tmp, lib)
    return lib


def damage(lib: Path) -> str | None:
    """What is wrong with the built library `lib`, in words that follow its name ("does not match its digest"); None
    when nothing is."""
    try:
        expected = digest_path(lib).read_text().strip()
    except FileNotFoundError:
        return "has no digest beside it"
    except (OSError, UnicodeDecodeError) as exc:
        return f"has a digest that cannot be read ({exc})"
    try:
        data = lib.read_bytes()
    except OSError as exc:
        return f"cannot be read ({exc})"
    if hashlib.sha256(data).hexdigest() != expected:
        return f"does not match its digest ({len(data)} bytes: truncated or overwritten)"
    return None


def delete(lib: Path) -> None:
    """Deletes the library `lib` and its digest, whatever stands in their place (a folder too)."""
    for path in (lib, digest_path(lib)):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


def load(cxx: str, out_folder: Path) -> ctypes.CDLL:
    """The kernel library, built unless it is there, checked against its digest, then loaded. One that is damaged
    (`damage`) or does not load is deleted and built again, once, with a warning that says what was wrong; where
    that fails too, the error says both."""
    lib = build(cxx, out_folder)
    problem = damage(lib)
    if problem is None:
        try:
            return ctypes.CDLL(str(lib))
        except OSError as exc:
            problem = f"does not load ({exc})"
    delete(lib)
    try:
        lib = build(cxx, out_folder)
        if again := damage(lib):
            raise RuntimeError(f"it still {again}")
        loaded = ctypes.CDLL(str(lib))
    except Exception as exc:
        raise RuntimeError(f"the kernel library {lib} {problem}; deleting and building it again failed: {exc}") from exc
    warnings.warn(f"gdn_jax: the CPU kernel library {lib} {problem}: deleted and built again", RuntimeWarning,
                  stacklevel=user_stacklevel())
    return loaded


def _succeeded(cxx: str, code: int, messages: str) -> None:
    """Raises an error with the end of the compiler's messages if its run (exit `code`) failed."""
    if code:
        raise RuntimeError(f"{cxx} failed (exit {code}): {messages.strip()[-600:]}")


@functools.cache
def available() -> bool:
    """Whether steps on this process's CPU backend run the compiled kernels: built (or found) and
    registered with XLA once per process. See the module's docstring for `KERNELS_ENV`."""
    setting = _setting()
    if setting == "0" or jax.default_backend() != "cpu":
        return False
    try:
        cxx = compiler()
        if cxx is None:
            named = f": {envs.get('CXX')!r}" if envs.get("CXX") else ""
            raise RuntimeError(f"no C++ compiler on PATH (c++, g++ or clang++; or name one in CXX{named})")
        lib = load(cxx, folder())
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.GdnJaxGdnDecode), platform="cpu")
        jax.ffi.register_ffi_target(PREFILL_TARGET, jax.ffi.pycapsule(lib.GdnJaxGdnPrefill), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.GdnJaxAttentionDecode), platform="cpu")
        jax.ffi.register_ffi_target(ROWS_TARGET, jax.ffi.pycapsule(lib.GdnJaxRowsProduct), platform="cpu")
    except Exception as exc:
        if setting == "1":
            raise RuntimeError(f"{KERNELS_ENV}=1, but the CPU kernels could not be built or loaded: {exc}") from exc
        warnings.warn(f"gdn_jax: the CPU kernels could not be built or loaded ({exc}); steps run XLA's forms of "
                      f"the GDN rule (prefill: the chunked \"fused\" schedule), decode attention and few-row "
                      f"products (slower; {KERNELS_ENV}=0 says so without trying)",
                      RuntimeWarning, stacklevel=user_stacklevel())
        return False
    return True
