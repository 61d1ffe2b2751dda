"""The shipped `tiny` model (gdn_jax/models/tiny, trained by scripts/tools/train_tiny.py): it is what `LLM("tiny")` loads,
its held-out bits per byte are the model card's, and its greedy text is printable English-like text from its corpus."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from pydoc_data import topics

from gdn_jax import LLM, SamplingParams
from gdn_jax.config import FULL, LINEAR, get_preset
from gdn_jax.train import Forward, bits_per_byte, encode, load_corpus, reference_documents
from gdn_jax.model.weights import MODELS_DIR, load_hf_weights, load_model, model_folder, shipped_models

pytestmark = pytest.mark.startup

FOLDER = MODELS_DIR / "tiny"
CARD = FOLDER / "README.md"


def card_bpb(dtype: str) -> float:
    m = re.search(rf"{dtype} (\d+\.\d+)", CARD.read_text())
    assert m, f"no {dtype} bits/byte in the model card"
    return float(m.group(1))


@pytest.fixture(scope="module")
def shipped():
    return load_hf_weights(FOLDER)


def test_tiny_is_the_shipped_folder_and_tiny_random_the_preset(shipped):
    cfg, _, _ = shipped
    assert shipped_models() == ["tiny"] and model_folder("tiny") == FOLDER
    assert model_folder("tiny-random") is None and get_preset("tiny-random").name == "tiny-random"
    assert cfg.name == "tiny" and cfg.eos_token_id == 1 and cfg.max_position_embeddings >= 4096
    # the Qwen3.5 hybrid layout: at least 8 layers, every 4th full attention
    assert cfg.num_hidden_layers >= 8
    assert cfg.layer_types == tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(cfg.num_hidden_layers))
    assert (FOLDER / "model.safetensors").stat().st_size <= 30 * 2**20
    assert load_model("tiny")[0] == cfg


@pytest.mark.slow
def test_heldout_bits_per_byte_match_the_model_card(shipped):
    """Re-measures the card's figure on the shipped held-out slice, float32 path (the card's figure is float32 too;
    the tolerance covers run-to-run reduction order). The bfloat16 figure of the card is close to it."""
    cfg, _, params = shipped
    training = json.loads((FOLDER / "training.json").read_text())
    text = (FOLDER / "validation.txt").read_text()
    assert len(text.encode()) == training["heldout_bytes"]
    topics_sha = hashlib.sha256(Path(topics.__file__).read_bytes()).hexdigest()
    if topics_sha.startswith(re.search(r"sha256 `([0-9a-f]+)`", CARD.read_text()).group(1)):
        # this Python carries the very corpus the model was trained on: the slice is the training script's cut
        assert load_corpus(training["args"]["heldout_bytes"]).heldout_text == text
    measured = bits_per_byte(Forward(cfg), params, encode(text), training["eval_window"])
    assert measured == pytest.approx(card_bpb("float32"), abs=0.01)
    assert measured == pytest.approx(training["val_bpb_float32"], abs=0.01)
    assert measured < 2.5  # the target; uniform over bytes is 8
    assert card_bpb("bfloat16") == pytest.approx(card_bpb("float32"), abs=0.05)


@pytest.mark.slow
def test_tiny_greedy_text_is_printable_english_from_the_corpus():
    llm = LLM("tiny", max_model_len=512, max_num_seqs=2, chunk_stride=64, verbose=False)
    prompts = ["The \"for\" statement is used to", "A function definition defines"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=160), use_tqdm=False)
    vocab = set(re.findall(r"[a-z]+", " ".join(reference_documents()).lower()))
    for o in outs:
        data = bytes(t - 4 for t in o.outputs[0].token_ids if 4 <= t < 260)
        assert len(o.outputs[0].token_ids) >= 40, o.outputs[0].text  # it speaks, not an early EOS
        printable = sum(32 <= b < 127 or b in (9, 10) for b in data) / len(data)
        assert printable >= 0.95, o.outputs[0].text
        words = re.findall(r"[a-z]+", data.decode(errors="replace").lower())
        assert len(words) >= 10, o.outputs[0].text
        known = np.mean([w in vocab for w in words])
        assert known >= 0.8, (known, o.outputs[0].text)


@pytest.mark.slow
def test_tiny_ships_a_trained_mtp_block_that_drafts_the_models_greedy_token():
    """Its MTP block (scripts/tools/train_tiny_mtp.py) loads when asked for; teacher-forced on held-out windows its
    greedy draft equals the model's own greedy token at the next position about two times in three (a random
    block: 1 in 15), as its training record says."""
    from gdn_jax.train import mtp_heldout

    cfg, _, params = load_hf_weights(FOLDER, mtp=True)
    record = json.loads((FOLDER / "mtp_training.json").read_text())
    got = mtp_heldout(cfg, params, encode((FOLDER / "validation.txt").read_text()), 16)
    assert got["agrees_with_main_greedy"] >= 0.6 and record["after"]["agrees_with_main_greedy"] >= 0.6
    assert got["agrees_with_main_greedy"] == pytest.approx(record["after"]["agrees_with_main_greedy"], abs=0.05)
