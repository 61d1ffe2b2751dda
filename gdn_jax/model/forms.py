"""The forms a step's trace takes: one frozen value that the model receives as an argument."""

from __future__ import annotations

import dataclasses

UNROLL_SETTINGS = ("0", "1", "decode")
PAGED_DECODE_SETTINGS = ("off", "on", "interpret")
VECTOR_BITS = (256, 512)


@dataclasses.dataclass(frozen=True)
class Forms:
    """Every choice a step's trace depends on besides its arguments' shapes and dtypes, resolved before tracing.

    The default is XLA's generic forms, with no CPU specifics and no compiled kernels: what training and direct model
    calls get. The engine resolves its own once, at start (`backends.cpu.tuning.resolve_forms`). Hashable, so that
    it can key the jitted step functions and the executable store."""

    cpu: bool = False                        # XLA's CPU backend's forms of products, attention and state updates
    kernels: bool = False                    # the compiled CPU kernels (loaded and registered with XLA beforehand)
    bf16_upcast: bool = False                # 16-bit products of many rows multiplied in float32
    few_rows_weight_left: bool = False       # bfloat16 products of 1-15 rows with the weight on the left
    rows_kernel_rows: int = 0                # most rows (from 2) of a bfloat16 product the few-row kernel takes
    f32_rows_kernel_rows: int = 0            # the same for float32 products
    prefill_kv_chunk_keys: int | None = None  # keys per attention iteration in prefill steps (None: the default)
    unroll: str = "0"                        # layers traced one by one: "1" every step, "decode" one-token steps
    decode_vector_bits: int = 256            # LLVM's vector width of narrow decode steps (a compile option)
    deterministic: bool = False              # the batch-invariant forward (`model.deterministic`)
    paged_decode: str = "off"                # one-token attention by the GPU's paged kernel: "on", "interpret" (CPU)

    def __post_init__(self):
        if self.kernels and not self.cpu:
            raise ValueError("Forms.kernels=True needs cpu=True: the kernels run on XLA's CPU backend only")
        if self.deterministic and (self.cpu or self.unroll != "0" or self.paged_decode != "off"):
            raise ValueError("Forms.deterministic=True takes XLA's generic forms: cpu=False, kernels=False, "
                             "unroll='0', paged_decode='off'")
        if self.paged_decode not in PAGED_DECODE_SETTINGS:
            raise ValueError(f"Forms.paged_decode must be one of {PAGED_DECODE_SETTINGS}, got {self.paged_decode!r}")
        if self.paged_decode != "off" and self.cpu:
            raise ValueError("Forms.paged_decode needs cpu=False: the CPU's one-token attention is its own kernel")
        if self.unroll not in UNROLL_SETTINGS:
            raise ValueError(f"Forms.unroll must be one of {UNROLL_SETTINGS}, got {self.unroll!r}")
        if self.decode_vector_bits not in VECTOR_BITS:
            raise ValueError(f"Forms.decode_vector_bits must be one of {VECTOR_BITS}, got {self.decode_vector_bits}")
        for name in ("rows_kernel_rows", "f32_rows_kernel_rows"):
            if getattr(self, name) < 0 or (getattr(self, name) and not self.kernels):
                raise ValueError(f"Forms.{name} must be 0, or positive with kernels=True, got "
                                 f"{getattr(self, name)} (kernels={self.kernels})")
        if self.prefill_kv_chunk_keys is not None and self.prefill_kv_chunk_keys < 1:
            raise ValueError(f"Forms.prefill_kv_chunk_keys must be positive or None, got {self.prefill_kv_chunk_keys}")

    def unrolled(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens per row traces every layer with its index known (`unroll`)."""
        return self.unroll == "1" or (self.unroll == "decode" and tokens == 1)


GENERIC = Forms()
DETERMINISTIC = Forms(deterministic=True)
