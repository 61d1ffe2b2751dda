"""Tokenizers: a reversible byte-level one for the built-in presets, `tokenizers` for HF folders."""

from __future__ import annotations

import codecs
from pathlib import Path


class TextStream:
    """The text of a growing token sequence, `tokenizer.decode(all ids so far)`, fed a few ids at a time. This generic
    one decodes every id again on each `add` (exact for any tokenizer); `ByteTextStream` only decodes the new ones."""

    def __init__(self, decode):
        self._decode, self.ids = decode, []

    @property
    def num_ids(self) -> int:
        return len(self.ids)

    def add(self, ids) -> str:
        self.ids.extend(ids)
        return self._decode(self.ids)


class ByteTextStream:
    """`ByteTokenizer.decode` of a growing sequence in time proportional to the new ids: the bytes go through Python's
    incremental UTF-8 decoder (errors "replace"), which holds back an incomplete trailing character; that held-back
    tail is rendered as the one-shot decode renders it (one replacement character), so every `add` returns exactly
    `decode(all ids so far)`, and a decode step's detokenisation no longer grows with the output length."""

    def __init__(self, offset: int):
        self._offset, self._text, self.num_ids = offset, "", 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, ids) -> str:
        lo, hi = self._offset, 256 + self._offset
        self.num_ids += len(ids)
        self._text += self._utf8.decode(bytes(i - lo for i in ids if lo <= i < hi))
        pending = self._utf8.getstate()[0]
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text


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

    def stream(self) -> ByteTextStream:
        return ByteTextStream(self.OFFSET)


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

    def stream(self) -> TextStream:
        # a subword decoder may rewrite the start of a piece (Metaspace's leading space) or merge bytes across
        # pieces, so a piecewise decode is not exact in general: decode the whole sequence again
        return TextStream(self.decode)


def get_tokenizer(folder: str | None, vocab_size: int, eos_token_id: int | None):
    """`tokenizer.json` of a model folder if it has one, else the byte-level tokenizer."""
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        return HFTokenizer(Path(folder) / "tokenizer.json", eos_token_id)
    return ByteTokenizer(vocab_size)
