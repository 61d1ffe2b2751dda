"""Tokenizers: a reversible byte-level one for the built-in presets, `tokenizers` for HF folders."""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path

from gdn_jax.config import folder_file


class TextStream:
    """The text of a growing token sequence, `tokenizer.decode(all ids so far)`, fed a few ids at a time. This generic
    one decodes every id again on each `add` (exact for any tokenizer); `Utf8TextStream` only decodes the new ones."""

    appends_only = False  # a whole decode may rewrite text before `num_chars` (WordPiece's cleanup)

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

    appends_only = True  # the text before `num_chars` never changes (a stop string search need not cover it again)

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


class PieceTextStream:
    """The text of a growing token sequence for a SentencePiece-style decoder (`HFTokenizer.stream`), in time
    proportional to the new ids, each token read as the library's decoder reads it: `piece(token, first)` is its text
    (`first`: it is the sequence's first token), or with byte fallback the byte a "<0xXX>" token stands for; a run of
    byte tokens reads as its UTF-8 if that is valid, else as one replacement character per byte; then up to
    `strip[1]` leading `strip[0]` characters of the whole text are left out (Strip after Fuse)."""

    appends_only = True  # the text before `num_chars` never changes (a stop string search need not cover it again)

    def __init__(self, token, piece, strip: tuple[str, int]):
        self._token, self._piece, (self._strip_char, self._strip) = token, piece, strip
        self._done, self._run, self._first, self.num_ids = "", bytearray(), True, 0

    @property
    def num_chars(self) -> int:
        """Characters of the text so far that later ids cannot change: those before an open run of byte tokens (one
        more byte can turn the characters a run reads as into replacement characters)."""
        return len(self._stripped(self._done))

    def add(self, ids) -> str:
        for i in ids:
            self.num_ids += 1
            token = self._token(i)
            if token is None:  # a special token, or an id outside the vocabulary: skipped
                continue
            piece, self._first = self._piece(token, self._first), False
            if isinstance(piece, int):
                self._run.append(piece)
            else:
                self._done += self._read_run() + piece
                self._run.clear()
        return self._stripped(self._done + self._read_run())

    def _read_run(self) -> str:
        try:
            return self._run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(self._run)

    def _stripped(self, text: str) -> str:
        head = text[:self._strip]
        return text[len(head) - len(head.lstrip(self._strip_char)):] if head else text


def text_stream(tokenizer) -> Utf8TextStream | PieceTextStream | TextStream:
    """An incremental decoder of a growing sequence: the tokenizer's own (`stream`), else the generic one."""
    make = getattr(tokenizer, "stream", None)
    return make() if make is not None else TextStream(tokenizer.decode)


class TextOffsets:
    """Where each id of a growing sequence begins in the sequence's decoded text, in characters from `start`: the
    characters of the ids before it that later ids cannot change (the stream's `num_chars`). An id that ends inside a
    multi-byte character leaves the next id at that character's start (with byte fallback: at the start of the run of
    byte tokens), so the offsets never decrease and never pass the text's length. With a byte-level or a
    SentencePiece-style tokenizer each id costs its own bytes; any other decodes the sequence whole per id (quadratic
    in its length)."""

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


# a byte-fallback token as the library's ByteFallback reads it: "<0x" two hex digits (or "+" and one) ">"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")


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

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids` (a special id has none, whatever `skip_special_tokens` says)."""
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
        self._pieces = self._sentencepiece_decoder()  # how a SentencePiece-style decoder reads tokens (`stream`)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids`, special tokens left out unless `skip_special_tokens` is False (logprobs' decoded tokens
        keep them, as vLLM's do)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The bytes id `i` stands for: its byte-level bytes or its byte-fallback byte (which may be part of a
        character), else the UTF-8 of its text alone, a special token's included."""
        if self._token_bytes is not None and i in self._token_bytes:
            return self._token_bytes[i]
        if self._pieces is not None and (token := self._pieces[0](i)) is not None:
            piece = self._pieces[1](token, True)
            if isinstance(piece, int):
                return bytes([piece])
        return self.decode([i], skip_special_tokens=False).encode("utf-8")

    def stream(self) -> Utf8TextStream | PieceTextStream | TextStream:
        """An incremental decoder of an output. With a byte-level decoder (Qwen's tokenizers) `decode` is the UTF-8
        reading (errors replaced) of the ids' bytes joined, each id's bytes its own: a `Utf8TextStream` over a table
        of them, in time proportional to the new ids. A SentencePiece-style decoder (Llama 2's, Gemma's, Metaspace)
        reads each token alone but for runs of byte-fallback tokens and the text's start: a `PieceTextStream`, in
        time proportional to the new ids too. Any other decoder may merge pieces or rewrite text across them
        (WordPiece's cleanup), so a piecewise decode is not exact in general: the sequence is decoded whole again on
        every step."""
        if self._token_bytes is not None:
            table = self._token_bytes
            return Utf8TextStream(lambda ids: b"".join(table.get(i, b"") for i in ids))
        if self._pieces is not None:
            return PieceTextStream(*self._pieces)
        return TextStream(self.decode)

    def _sentencepiece_decoder(self) -> tuple | None:
        """(token, piece, strip) for `PieceTextStream` when the decoder is SentencePiece-style (else None): a
        Metaspace decoder, or a sequence of string Replaces and Metaspaces (each token's own text), then ByteFallback,
        Fuse and a Strip of the text's start, each optional, in that order, as the library applies them."""
        if self._tok.decoder is None:
            return None
        spec = json.loads(self._tok.decoder.__getstate__())
        steps = spec["decoders"] if spec["type"] == "Sequence" else [spec]
        rewrites, bytes_, strip, stage = [], False, (" ", 0), 0
        for step in steps:  # stage: 0 per-token rewrites, 1 ByteFallback, 2 Fuse, 3 Strip; never back
            kind = step["type"]
            if kind == "Replace" and stage == 0 and "String" in step["pattern"]:
                rewrites.append((step["pattern"]["String"], step["content"], False))
            elif kind == "Metaspace" and stage == 0:
                rewrites.append((step["replacement"], " ", step.get("prepend_scheme", "always") != "never"))
            elif kind == "ByteFallback" and stage == 0:
                bytes_, stage = True, 1
            elif kind == "Fuse" and stage <= 1:
                stage = 2
            elif kind == "Strip" and stage == 2 and step["stop"] == 0:
                strip, stage = (step["content"], step["start"]), 3
            else:
                return None

        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}

        def token(i: int) -> str | None:  # the library skips a special token by its text, an unknown id too
            t = self._tok.id_to_token(i)
            return None if t in special else t

        def piece(token: str, first: bool) -> str | int:
            for old, new, drop_first in rewrites:  # Metaspace drops the first token's replacement characters
                token = token.replace(old, "" if first and drop_first else new)
            byte = _BYTE_TOKEN.fullmatch(token) if bytes_ else None
            return int(byte[1], 16) if byte else token

        return token, piece, strip

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
    path = folder_file(folder, "tokenizer.json")
    if path is not None:
        tokenizer = HFTokenizer(path, eos_token_id)
        # an id the model has no row for: any text that tokenizes to it would be refused, the rest run with a
        # tokenizer of another model
        largest = max(tokenizer._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        if largest >= vocab_size:
            raise ValueError(f"{path} has token ids up to {largest}, outside the model's vocabulary of {vocab_size} "
                             f"ids: the tokenizer is not this model's")
        return tokenizer
    other = [name for name in OTHER_VOCABULARY_FILES if folder_file(folder, name) is not None]
    if other:
        raise ValueError(f"model folder {folder} has no tokenizer.json, only {', '.join(other)}: save the tokenizer "
                         f"with the fast tokenizer (tokenizer.json) to use it here")
    if folder is not None and vocab_size < 256 + ByteTokenizer.OFFSET:  # else the error names only ByteTokenizer
        raise ValueError(f"model folder {folder} has no tokenizer.json, and its vocabulary of {vocab_size} ids is too "
                         f"small for the byte-level tokenizer used without one ({256 + ByteTokenizer.OFFSET} ids)")
    return ByteTokenizer(vocab_size)
