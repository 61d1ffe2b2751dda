"""A damaged CPU kernel library (gdn_jax.backends.cpu.library): truncated, garbled, unreadable, or without its digest,
it is deleted and built again with one warning, or where that fails steps run XLA's forms; never a crash. Each start
runs in a process of its own, so that a crash shows as its exit status."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_jax.backends.cpu import library

pytestmark = pytest.mark.model

START = """
import json, sys, warnings
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])  # the kernels' folder: <cache>/kernels
from gdn_jax.backends.cpu import library
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kernels = library.available()
print(json.dumps({"kernels": kernels, "warnings": [str(w.message) for w in caught]}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The kernel library, built once with the system's compiler for the tests of this file."""
    cxx = library.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    lib = library.build(cxx, tmp_path_factory.mktemp("built") / "kernels")
    assert library.damage(lib) is None  # the build wrote the digest of what it built
    return lib


def _compiler(folder: Path, built: Path, link_error: str | None = None) -> Path:
    """A stand-in C++ compiler that logs its calls to `folder/calls` and links by copying `built` (or fails to link
    with `link_error`): building again costs nothing, and what is loaded is the real library."""
    fake = folder / "c++"
    link = f"echo '{link_error}' >&2; exit 1" if link_error else f'cp "{built}" "$2"'
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {folder / "calls"}
while [ "$1" != "-o" ]; do shift; done
case "$2" in *.o) touch "$2"; exit 0 ;; esac
{link}
""")
    fake.chmod(0o755)
    return fake


def _start(tmp_path: Path, built: Path, damage, link_error: str | None = None, required: bool = False):
    """A copy of `built` in a fresh cache folder, damaged by `damage`, then a process that starts on it. Returns the
    library's path, the process's result and the stand-in compiler's links."""
    fake = _compiler(tmp_path, built, link_error)
    lib = library.library_path(str(fake), tmp_path / "cache" / "kernels")
    lib.parent.mkdir(parents=True)
    shutil.copyfile(built, lib)
    shutil.copyfile(library.digest_path(built), library.digest_path(lib))
    damage(lib)
    env = {k: v for k, v in os.environ.items() if k != library.KERNELS_ENV}
    env.update(CXX=str(fake), JAX_PLATFORMS="cpu", **({library.KERNELS_ENV: "1"} if required else {}))
    done = subprocess.run([sys.executable, "-c", START, str(tmp_path / "cache")], env=env, capture_output=True,
                          text=True, timeout=300)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return lib, done, [call for call in calls if " -c " not in call]


def truncate(lib: Path) -> None:  # a disk quota reached while it was written
    lib.write_bytes(lib.read_bytes()[:lib.stat().st_size // 2])


def garble(lib: Path) -> None:
    data = bytearray(lib.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    lib.write_bytes(bytes(data))


def unreadable(path: Path) -> None:  # a folder in its place: as root, a mode of 000 does not stop a read
    path.unlink()
    path.mkdir()


def not_a_library(lib: Path) -> None:  # bytes and digest that match, and do not load
    lib.write_bytes(b"not a library")
    library.digest_path(lib).write_text(hashlib.sha256(b"not a library").hexdigest())


DAMAGES = {
    "truncated": (truncate, "does not match its digest"),
    "garbled": (garble, "does not match its digest"),
    "unreadable": (unreadable, "cannot be read ([Errno 21] Is a directory"),
    "no-digest": (lambda lib: library.digest_path(lib).unlink(), "has no digest beside it"),
    "unreadable-digest": (lambda lib: unreadable(library.digest_path(lib)), "has a digest that cannot be read"),
    "not-a-library": (not_a_library, "does not load ("),
}


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_library_is_built_again_with_one_warning(tmp_path, built, case):
    """The start loads the kernels, having built the library again once, and says what was wrong with it; without
    the check a truncated library ended the process (SIGBUS) and a garbled one loaded."""
    damage, what = DAMAGES[case]
    lib, done, links = _start(tmp_path, built, damage)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["kernels"] is True and len(out["warnings"]) == 1, out
    assert f"{lib} {what}" in out["warnings"][0] and "deleted and built again" in out["warnings"][0]
    assert len(links) == 1 and library.damage(lib) is None and lib.read_bytes() == built.read_bytes()


def test_a_damaged_library_that_cannot_be_built_again_means_xla_forms_or_a_named_error(tmp_path, built):
    """Building again fails too (the disk still full): steps run XLA's forms, with one warning that says both
    failures, and the damaged library is gone; with GDN_JAX_CPU_KERNELS=1, an error that says both."""
    lib, done, links = _start(tmp_path, built, truncate, link_error="ld: Disk quota exceeded")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["kernels"] is False and len(out["warnings"]) == 1 and len(links) == 1, out
    said = out["warnings"][0]
    assert all(part in said for part in (f"{lib} does not match its digest", "Disk quota exceeded", "XLA's forms"))
    assert not lib.exists() and not library.digest_path(lib).exists()

    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "calls").unlink()
    lib, done, _ = _start(tmp_path, built, truncate, link_error="ld: Disk quota exceeded", required=True)
    assert done.returncode == 1, done.stderr[-2000:]  # an error, not a signal
    assert all(part in done.stderr for part in ("GDN_JAX_CPU_KERNELS=1, but the CPU kernels could not be built",
                                                f"{lib} does not match its digest", "Disk quota exceeded"))


def test_the_digest_is_in_place_before_the_library(tmp_path, built, monkeypatch):
    """A process that finds the library finds its digest (not a library it would take for damaged), and never a
    library half-written: both are renamed into place, the digest first."""
    fake = _compiler(tmp_path, built)
    lib = library.library_path(str(fake), tmp_path / "kernels")
    renamed, replace = [], os.replace

    def recording(src, dst):
        renamed.append((Path(dst).name, library.digest_path(lib).exists()))
        replace(src, dst)

    monkeypatch.setattr(library.os, "replace", recording)
    assert library.build(str(fake), tmp_path / "kernels") == lib
    assert renamed == [(library.digest_path(lib).name, False), (lib.name, True)]
    assert sorted(p.name for p in lib.parent.iterdir()) == [lib.name, library.digest_path(lib).name]
    assert library.damage(lib) is None
