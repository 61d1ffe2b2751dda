"""Every environment variable gdn-jax reads, declared once: name, allowed values, default and meaning.

This is the only module of the package that reads `os.environ`. Each variable is read when asked for (`get`), so a
test or a notebook may set it before building an engine; a value outside its choices is a ValueError naming the
variable.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    doc: str
    choices: tuple[str, ...] | None = None  # the allowed non-empty values (None: any)
    positive_int: bool = False              # a positive whole number

    def get(self) -> str:
        """The variable's value, stripped ("" when unset), validated."""
        text = os.environ.get(self.name, "").strip()
        if not text:
            return ""
        if self.choices is not None and text not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)} (or unset), got {text!r}")
        if self.positive_int and (not text.isdigit() or int(text) < 1):
            raise ValueError(f"{self.name} must be a positive whole number, got {text!r}")
        return text


VARIABLES = {v.name: v for v in (
    Variable("GDN_JAX_CACHE_DIR", "folder of the persistent compilation cache, the executable store, the CPU kernels "
             "and the machine's measured choices; 'off' disables it (default: $XDG_CACHE_HOME/gdn_jax/jax, else "
             "~/.cache/gdn_jax/jax)"),
    Variable("GDN_JAX_CACHE_MAX_MB", "bound of the compilation cache folder in MiB, or -1 for none (default 2048)"),
    Variable("GDN_JAX_CPU_KERNELS", "compiled CPU kernels: 0 never, 1 required, unset when they build",
             choices=("0", "1")),
    Variable("GDN_JAX_BF16_UPCAST", "many-row bfloat16 products in float32 on the CPU: 1 always, 0 never, unset "
             "measured", choices=("0", "1")),
    Variable("GDN_JAX_BF16_FEW_ROWS_WEIGHT_LEFT", "1-15-row bfloat16 products with the weight on the left on the "
             "CPU: 1 always, 0 never, unset measured", choices=("0", "1")),
    Variable("GDN_JAX_F32_ROWS_KERNEL", "2-16-row float32 products by the compiled kernel: 1 always, 0 never, "
             "unset measured", choices=("0", "1")),
    Variable("GDN_JAX_BF16_ROWS_KERNEL", "2-16-row bfloat16 products by the compiled kernel: 1 always, 0 never, "
             "unset measured", choices=("0", "1")),
    Variable("GDN_JAX_DECODE_VECTOR_BITS", "LLVM vector width of narrow decode steps on the CPU: 256 or 512, unset "
             "measured", choices=("256", "512")),
    Variable("GDN_JAX_PREFILL_KV_CHUNK_KEYS", "keys per iteration of a prefill step's attention loop (default 256)",
             positive_int=True),
    Variable("GDN_JAX_UNROLL_LAYERS", "trace every layer with its index known: 1 every step, decode one-token steps, "
             "0 or unset none", choices=("0", "1", "decode")),
    Variable("GDN_JAX_PAGED_DECODE", "one-token attention on a GPU by the paged Pallas kernel: 1 on, 0 or unset off "
             "(XLA's loop over key chunks)", choices=("0", "1")),
    Variable("GDN_JAX_COMPILE_THREADS", "threads the warm-up compiles on (default: the usable cores, at most 8)",
             positive_int=True),
    Variable("GDN_JAX_EXECUTABLE_STORE", "0 keeps compiled steps in JAX's persistent cache alone, without the "
             "executable store beside it (default: the store is on with the cache)", choices=("0", "1")),
    Variable("GDN_JAX_COORDINATOR_ADDRESS", "host:port of process 0 when one engine runs on several hosts "
             "(gdn_jax.distributed)"),
    Variable("GDN_JAX_NUM_PROCESSES", "processes of a several-host engine", positive_int=True),
    Variable("GDN_JAX_PROCESS_ID", "this process's index among them, from 0"),
    Variable("GDN_JAX_API_KEY", "the server's API key when --api-key is not given"),
    Variable("CXX", "the C++ compiler the CPU kernels are built with (default: c++, g++ or clang++ on PATH)"),
    Variable("XLA_FLAGS", "XLA's own flags; an optimisation level named there overrides the prefill steps' level"),
    Variable("XDG_CACHE_HOME", "the user's cache folder, under which the compilation cache lives by default"),
)}

# Variables that change a compiled step without appearing in its arguments: part of the executable store's key.
COMPILE_AFFECTING = ("XLA_FLAGS", "GDN_JAX_UNROLL_LAYERS", "GDN_JAX_PREFILL_KV_CHUNK_KEYS", "GDN_JAX_CPU_KERNELS",
                     "GDN_JAX_PAGED_DECODE")


def get(name: str) -> str:
    """The validated value of a declared variable ("" when unset)."""
    return VARIABLES[name].get()


def optional_bool(name: str) -> bool | None:
    """A 0/1 variable as False/True, None when unset."""
    text = get(name)
    return None if not text else text == "1"


def optional_int(name: str) -> int | None:
    """A numeric variable as an int, None when unset."""
    text = get(name)
    return int(text) if text else None
