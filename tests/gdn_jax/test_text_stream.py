"""Incremental detokenisation: a stream fed a few ids at a time returns exactly `decode(all ids so far)`."""

import numpy as np
import pytest

from gdn_jax.tokenizer import ByteTokenizer, TextStream, text_offsets

# bytes that make partial, complete, overlong, surrogate and stray UTF-8 sequences, plus ids outside the byte range
_BYTES = [0x41, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 0xC0, 0xED, 0xA0, 0xF4, 0x90, 0xBF]


def test_byte_stream_matches_the_whole_decode_after_every_piece():
    tok, rng = ByteTokenizer(300), np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(1, 40))
        ids = [int(b) + tok.OFFSET if rng.random() < 0.85 else int(rng.integers(0, 300))
               for b in rng.choice(_BYTES, n)]
        stream, seen = tok.stream(), 0
        while seen < n:
            k = int(rng.integers(1, 4))
            text = stream.add(ids[seen:seen + k])
            seen = min(n, seen + k)
            assert text == tok.decode(ids[:seen]) and stream.num_ids == seen


def test_a_split_character_shows_as_one_replacement_until_it_completes():
    tok = ByteTokenizer(300)
    euro = [b + tok.OFFSET for b in "€".encode()]
    stream = tok.stream()
    assert stream.add(euro[:1]) == "\ufffd" and stream.add(euro[1:2]) == "\ufffd" and stream.add(euro[2:]) == "€"


def test_generic_stream_decodes_everything_it_was_fed():
    tok = ByteTokenizer(300)
    stream = TextStream(tok.decode)
    ids = [b + tok.OFFSET for b in "a€b".encode()]
    assert [stream.add([i]) for i in ids][-1] == "a€b" and stream.num_ids == len(ids)


def _byte_level_tokenizer(tmp_path, decoder="byte_level"):
    """A small byte-level BPE tokenizer.json (Qwen's kind) with added tokens of every sort: in the byte-level
    alphabet ("Ġplain", "naïve": 'ï' stands for the byte 0xEF there), outside it (a space, CJK), and special ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = {"byte_level": decoders.ByteLevel(), "metaspace": decoders.Metaspace(),
                 "wordpiece": decoders.WordPiece()}[decoder]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    t.train_from_iterator(["héllo wörld € 😀 the cache restores the state of a ψ layer"] * 20, trainer)
    t.add_tokens([AddedToken("<think>"), AddedToken("naïve"), AddedToken("Ġplain"), AddedToken("two words"),
                  AddedToken("你好")])
    t.add_special_tokens(["<|im_end|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    from gdn_jax.tokenizer import HFTokenizer
    return HFTokenizer(tmp_path / "tokenizer.json", None)


def _random_pieces(tok, rng, n):
    """n ids: mostly the vocabulary's (single bytes among them, which make partial UTF-8), some past its end."""
    top = max(tok._tok.get_vocab().values())
    return [int(rng.integers(0, top + 1)) if rng.random() < 0.95 else int(rng.integers(top + 1, top + 50))
            for _ in range(n)]


def test_byte_level_hf_stream_matches_the_library_decode_after_every_piece(tmp_path):
    tok, rng = _byte_level_tokenizer(tmp_path), np.random.default_rng(1)
    _stream_matches_decode(tok, rng, _random_pieces)


def _stream_matches_decode(tok, rng, make_ids):
    """300 random id sequences (`make_ids(tok, rng, n)`), each fed to `tok.stream()` 1-3 ids at a time: after every
    addition the stream's text is the library's decode of the ids so far."""
    for _ in range(300):
        ids = make_ids(tok, rng, int(rng.integers(1, 30)))
        stream, seen = tok.stream(), 0
        while seen < len(ids):
            k = int(rng.integers(1, 4))
            text = stream.add(ids[seen:seen + k])
            seen = min(len(ids), seen + k)
            assert text == tok.decode(ids[:seen]), [tok._tok.id_to_token(i) for i in ids[:seen]]
            assert stream.num_ids == seen


def test_byte_level_hf_stream_reads_broken_utf8_as_the_library_does(tmp_path):
    """Single-byte tokens in the mixes of partial, overlong, surrogate and stray UTF-8 sequences that the byte
    tokenizer's test uses: Python's replacement of invalid bytes agrees with the library's, piece by piece."""
    from gdn_jax.tokenizer import byte_level_alphabet

    tok, rng = _byte_level_tokenizer(tmp_path), np.random.default_rng(3)
    vocab, char = tok._tok.get_vocab(), {b: c for c, b in byte_level_alphabet().items()}
    byte_id = {b: vocab[char[b]] for b in _BYTES}
    for _ in range(400):
        ids = [byte_id[int(b)] for b in rng.choice(_BYTES, int(rng.integers(1, 40)))]
        stream, seen = tok.stream(), 0
        while seen < len(ids):
            k = int(rng.integers(1, 4))
            text = stream.add(ids[seen:seen + k])
            seen = min(len(ids), seen + k)
            assert text == tok.decode(ids[:seen]), [tok._tok.id_to_token(i) for i in ids[:seen]]


def test_byte_level_hf_stream_decodes_only_the_new_ids(tmp_path, monkeypatch):
    """The stream never asks the library to decode (its table has every id's bytes): a step's detokenisation
    does not grow with the output."""
    tok = _byte_level_tokenizer(tmp_path)
    ids = tok.encode("the cache restores <think>naïve 你好 state") + [max(tok._tok.get_vocab().values())]
    want = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    monkeypatch.setattr(tok, "decode", lambda ids: (_ for _ in ()).throw(AssertionError("whole decode")))
    stream = tok.stream()
    assert [stream.add([i]) for i in ids] == want
    assert want[-1] == "the cache restores <think>na\ufffdve 你好 state"  # the special token is skipped


def test_other_hf_decoders_decode_the_whole_sequence(tmp_path):
    """A decoder that rewrites text across pieces (here WordPiece, whose cleanup joins " ." into ".") gets a stream
    that decodes all ids again, and stays exact."""
    tok, rng = _byte_level_tokenizer(tmp_path, decoder="wordpiece"), np.random.default_rng(2)
    for _ in range(50):
        ids = _random_pieces(tok, rng, int(rng.integers(1, 20)))
        stream = tok.stream()
        assert isinstance(stream, TextStream)
        assert [stream.add([i]) for i in ids] == [tok.decode(ids[:i + 1]) for i in range(len(ids))]


def test_text_offsets_count_whole_characters_before_each_id(tmp_path):
    """Where each id's text begins, in characters: a byte inside a character is at that character's start; offsets
    never decrease and never pass the text's length (byte tokenizer, byte-level and other HF decoders)."""
    tok = ByteTokenizer(300)
    ids = tok.encode("aé日 x")  # 1 + 2 + 3 + 1 + 1 bytes
    assert text_offsets(tok, ids) == [0, 1, 1, 2, 2, 2, 3, 4] and text_offsets(tok, ids, 5)[0] == 5
    assert tok.token_bytes(ids[1]) + tok.token_bytes(ids[2]) == "é".encode() and tok.token_bytes(tok.EOS) == b""
    rng = np.random.default_rng(3)
    for decoder in ("byte_level", "metaspace"):
        hf = _byte_level_tokenizer(tmp_path, decoder)
        for _ in range(30):
            ids = _random_pieces(hf, rng, int(rng.integers(1, 20)))
            offsets, text = text_offsets(hf, ids), hf.decode(ids)
            assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
            for i, o in enumerate(offsets):  # what the ids before i decode to, but a trailing incomplete character
                prefix = hf.decode(ids[:i])
                if decoder == "byte_level":  # an incomplete character decodes to one replacement character
                    assert o == len(prefix) or (o == len(prefix) - 1 and prefix.endswith("\ufffd"))
                else:
                    assert o == len(prefix.rstrip("\ufffd"))


# SentencePiece decoders as tokenizer.json writes them: Llama 2 / Mistral (the leading space of the text stripped),
# Gemma (kept), and Metaspace (the first token's "▁" dropped)
_SENTENCEPIECE_DECODERS = ("llama", "gemma", "metaspace")


def _sentencepiece_tokenizer(folder, decoder="llama"):
    """A small SentencePiece-style BPE tokenizer.json with byte fallback (<0x00>..<0xFF>, ids 3..258), pieces with
    "▁" anywhere, pieces the library also reads as bytes ("<0x+F>", "<0xe9>"), a non-special added token and two
    special ones. Fewer than 512 ids, so the tiny test models can produce every one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁▁", "▁h", "▁the", "▁world", "a▁b", "h", "e", "l", "o", "ll", "é", "€", "▁é", ".", " ", "<0x+F>",
                  "<0xe9>", "x▁"]:
        vocab[piece] = len(vocab)
    t = Tokenizer(models.BPE(vocab, [("l", "l")], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    replace = decoders.Replace("▁", " ")
    t.decoder = {"llama": decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
                 "gemma": decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()]),
                 "metaspace": decoders.Metaspace()}[decoder]
    t.add_tokens([AddedToken("<think>")])
    t.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    t.save(str(folder / "tokenizer.json"))
    from gdn_jax.tokenizer import HFTokenizer
    return HFTokenizer(folder / "tokenizer.json", 2)


def _sentencepiece_ids(tok, rng, n):
    """n ids: byte-fallback tokens of the partial, invalid and whole UTF-8 sequences in `_BYTES` (runs of them), the
    other pieces, special ids and ids past the vocabulary."""
    top = max(tok._tok.get_vocab().values())
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.5:
            out += [3 + int(b) for b in rng.choice(_BYTES, int(rng.integers(1, 5)))]
        elif r < 0.9:
            out.append(int(rng.integers(259, top + 1)))
        else:
            out.append(int(rng.choice([0, 1, 2, top + 1, top + 7])))
    return out[:n]


@pytest.mark.parametrize("decoder", _SENTENCEPIECE_DECODERS)
def test_sentencepiece_stream_matches_the_library_decode_after_every_piece(tmp_path, decoder):
    tok, rng = _sentencepiece_tokenizer(tmp_path, decoder), np.random.default_rng(4)
    _stream_matches_decode(tok, rng, _sentencepiece_ids)


@pytest.mark.parametrize("decoder", _SENTENCEPIECE_DECODERS)
def test_sentencepiece_stream_decodes_only_the_new_ids(tmp_path, monkeypatch, decoder):
    """Like the byte-level stream: no whole decode per step, so a long output's detokenisation (and its text
    offsets, one stream step per id) does not grow with its length."""
    tok = _sentencepiece_tokenizer(tmp_path, decoder)
    ids = [1] + tok.encode("hello the world, é€ 😀😀 ψ") + [2, 400]
    want = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    monkeypatch.setattr(tok, "decode", lambda ids: (_ for _ in ()).throw(AssertionError("whole decode")))
    stream = tok.stream()
    assert [stream.add([i]) for i in ids] == want


@pytest.mark.parametrize("decoder", ("llama", "gemma"))
def test_a_run_of_byte_fallback_tokens_counts_as_text_only_once_it_ends(tmp_path, decoder):
    """The library reads a run of byte tokens whole: one more byte can turn characters it read into replacement
    characters ("😀" then "<0xF0>" is five of them; a run that ends inside a character stays so). So the stable
    text (`num_chars`) stops before an open run, every later text starts with it, and text offsets never
    decrease."""
    tok = _sentencepiece_tokenizer(tmp_path, decoder)
    emoji = [3 + b for b in "😀".encode()]
    e = tok.encode("é")[-1]
    for ids in ([e, *emoji, *emoji, e], [e, *emoji, 3 + 0xF0, e], [*emoji, 3 + 0xE2, 3 + 0x82]):
        stream, texts, stable = tok.stream(), [], []
        for i in ids:
            texts.append(stream.add([i]))
            stable.append(texts[-1][:stream.num_chars])
        assert texts[-1] == tok.decode(ids)
        assert all(later.startswith(s) for n, s in enumerate(stable) for later in texts[n:]), (texts, stable)
        offsets = text_offsets(tok, ids)
        assert offsets == sorted(offsets) and offsets[-1] <= len(texts[-1])


def test_a_byte_fallback_tokens_bytes_are_its_byte(tmp_path):
    """The chat API's logprob `bytes` let a client put together a character split over tokens: a "<0xXX>" token
    stands for its byte (its text alone is a replacement character), any other token for the UTF-8 of its text."""
    tok = _sentencepiece_tokenizer(tmp_path)
    ids = tok.encode("é😀")[-4:]
    assert [tok._tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == "😀".encode() and tok.decode(ids[:1]) == "\ufffd"
    assert tok.token_bytes(tok.encode("é")[-1]) == "é".encode() and tok.token_bytes(2) == b"</s>"
