"""Incremental detokenisation: a stream fed a few ids at a time returns exactly `decode(all ids so far)`."""

import numpy as np

from gdn_jax.tokenizer import ByteTokenizer, TextStream

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
