"""Tokenizers: a reversible byte-level one for the built-in presets, `tokenizers` for HF folders."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes shifted past a few special ids. Reversible for any text; ids >= 256 + OFFSET decode to ''."""

    PAD, EOS, BOS = 0, 1, 2
    OFFSET = 4

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"byte tokenizer needs a vocabulary of at least {256 + self.OFFSET} ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """Wraps a `tokenizer.json` with the `tokenizers` library (optional dependency)."""

    def __init__(self, path: Path, eos_token_id: int | None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("text prompts for this model need `pip install gdn-jax[tokenizers]`") from e
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def get_tokenizer(folder: str | None, vocab_size: int, eos_token_id: int | None):
    """`tokenizer.json` of a model folder if it has one, else the byte-level tokenizer."""
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        return HFTokenizer(Path(folder) / "tokenizer.json", eos_token_id)
    return ByteTokenizer(vocab_size)
