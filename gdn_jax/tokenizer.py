"""Tokenizers: a reversible byte-level one for the built-in presets, `tokenizers` for HF folders."""

from __future__ import annotations

import codecs
from pathlib import Path


class TextStream:
    """The text of a growing token sequence, `tokenizer.decode(all ids so far)`, fed a few ids at a time. This generic
    one decodes every id again on each `add` (exact for any tokenizer); `Utf8TextStream` only decodes the new ones."""

    def __init__(self, decode):
        self._decode, self.ids, self._text = decode, [], ""

    @property
    def num_ids(self) -> int:
        return len(self.ids)

    @property
    def num_chars(self) -> int:
        """Characters of the text so far that later ids cannot change, as far as a whole decode tells: all but
        trailing replacement characters (an incomplete multi-byte character)."""
        return len(self._text.rstrip("\ufffd"))

    def add(self, ids) -> str:
        self.ids.extend(ids)
        self._text = self._decode(self.ids)
        return self._text


class Utf8TextStream:
    """The text of a growing sequence of ids that decode to bytes, each id to its own (`to_bytes`: ids -> their bytes
    joined), the whole read as UTF-8 with errors replaced, in time proportional to the new ids: the bytes go through
    Python's incremental UTF-8 decoder (errors "replace"), which holds back an incomplete trailing character; that
    held-back tail is rendered as a one-shot decode renders it (one replacement character), so every `add` returns
    exactly the one-shot decode of all ids so far, and a decode step's detokenisation does not grow with the output
    length."""

    def __init__(self, to_bytes):
        self._to_bytes, self._text, self.num_ids = to_bytes, "", 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def num_chars(self) -> int:
        """Characters of the text so far that later ids cannot change: the whole characters decoded (an incomplete
        trailing one is not counted)."""
        return len(self._text)

    def add(self, ids) -> str:
        self.num_ids += len(ids)
        self._text += self._utf8.decode(self._to_bytes(ids))
        pending = self._utf8.getstate()[0]
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text


def text_stream(tokenizer) -> Utf8TextStream | TextStream:
    """An incremental decoder of a growing sequence: the tokenizer's own (`stream`), else the generic one."""
    make = getattr(tokenizer, "stream", None)
    return make() if make is not None else TextStream(tokenizer.decode)


class TextOffsets:
    """Where each id of a growing sequence begins in the sequence's decoded text, in characters from `start`: the
    whole characters the ids before it decode to. An id that ends inside a multi-byte character leaves the next id at
    that character's start, so the offsets never decrease and never pass the text's length. With a byte-level
    tokenizer each id costs its own bytes; any other decodes the sequence whole per id (quadratic in its length)."""

    def __init__(self, tokenizer, start: int = 0):
        self._stream, self._start, self.offsets = text_stream(tokenizer), start, []

    def add(self, ids) -> list[int]:
        """Appends `ids`; returns the offsets of all ids so far."""
        for i in ids:
            self.offsets.append(self._start + self._stream.num_chars)
            self._stream.add([i])
        return self.offsets


def text_offsets(tokenizer, ids, start: int = 0) -> list[int]:
    """`TextOffsets` of `ids` at once."""
    return TextOffsets(tokenizer, start).add(ids)


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's, used by Qwen's tokenizers): character -> the byte it stands for. The
    printable bytes ('!'-'~', '¡'-'¬', '®'-'ÿ') stand for themselves; the other 68, in increasing order, are
    U+0100, U+0101, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


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

    def token_bytes(self, i: int) -> bytes:
        """The bytes id `i` stands for (b"" for a special id)."""
        return bytes([i - self.OFFSET]) if self.OFFSET <= i < 256 + self.OFFSET else b""

    def stream(self) -> Utf8TextStream:
        lo, hi = self.OFFSET, 256 + self.OFFSET
        return Utf8TextStream(lambda ids: bytes(i - lo for i in ids if lo <= i < hi))


class HFTokenizer:
    """Wraps a `tokenizer.json` with the `tokenizers` library (optional dependency)."""

    def __init__(self, path: Path, eos_token_id: int | None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("text prompts for this model need `pip install gdn-jax[tokenizers]`") from e
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's message names no file
            raise ValueError(f"{path} cannot be read as a tokenizer: {e}") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_id = eos_token_id
        self._token_bytes = self._byte_level_table()  # per id its bytes, for a byte-level decoder (`stream`)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, i: int) -> bytes:
        """The bytes id `i` decodes to: its byte-level bytes (which may be part of a character), else the UTF-8 of
        its decode."""
        if self._token_bytes is not None:
            return self._token_bytes.get(i, b"")
        return self.decode([i]).encode("utf-8")

    def stream(self) -> Utf8TextStream | TextStream:
        """An incremental decoder of an output. With a byte-level decoder (Qwen's tokenizers) `decode` is the UTF-8
        reading (errors replaced) of the ids' bytes joined, each id's bytes its own: a `Utf8TextStream` over a table
        of them, in time proportional to the new ids. Any other decoder may rewrite the start of a piece (Metaspace's
        leading space) or merge pieces, so a piecewise decode is not exact in general: the sequence is decoded whole
        again on every step."""
        if self._token_bytes is None:
            return TextStream(self.decode)
        table = self._token_bytes
        return Utf8TextStream(lambda ids: b"".join(table.get(i, b"") for i in ids))

    def _byte_level_table(self) -> dict[int, bytes] | None:
        """id -> the bytes `decode` makes of it, when the decoder is byte-level alone (else None), as the library
        decodes: a special token is skipped, an id outside the vocabulary too; a token whose characters are all of
        the byte-level alphabet stands for their bytes, any other (an added token with a space or a character past
        U+00FF, say) for its own UTF-8."""
        from tokenizers import decoders

        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        alphabet = byte_level_alphabet()

        def token_bytes(token: str) -> bytes:
            chars = [alphabet.get(c) for c in token]
            return token.encode("utf-8") if None in chars else bytes(chars)

        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken (an added token may share a model token's text)
        table = {i: token_bytes(token) for token, i in self._tok.get_vocab(with_added_tokens=False).items()}
        for i, token in added.items():
            table.pop(i, None)
            if not token.special:
                table[i] = token_bytes(token.content)
        return table


# files that define a vocabulary other than bytes, in the formats this package does not read (the slow tokenizers')
OTHER_VOCABULARY_FILES = ("vocab.json", "merges.txt", "tokenizer.model")


def get_tokenizer(folder: str | None, vocab_size: int, eos_token_id: int | None):
    """`tokenizer.json` of a model folder if it has one, else the byte-level tokenizer. A folder whose vocabulary is
    given only in another format (vocab.json + merges.txt, tokenizer.model) is a ValueError naming them: the bytes
    would be the wrong ids for its model."""
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        return HFTokenizer(Path(folder) / "tokenizer.json", eos_token_id)
    other = [name for name in OTHER_VOCABULARY_FILES if folder is not None and (Path(folder) / name).is_file()]
    if other:
        raise ValueError(f"model folder {folder} has no tokenizer.json, only {', '.join(other)}: save the tokenizer "
                         f"with the fast tokenizer (tokenizer.json) to use it here")
    return ByteTokenizer(vocab_size)
