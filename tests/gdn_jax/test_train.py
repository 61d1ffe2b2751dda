"""The training path: its dense forward against the engine's prefill, gradients of the chunked rule, the corpus split,
and a reduced run of scripts/tools/train_tiny.py (loss goes down; an interrupted run resumes at the same step and ends
with the same weights)."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax import jax_compat
from gdn_jax.config import get_preset
from gdn_jax.model.gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from gdn_jax.model.qwen35 import forward, init_model
from gdn_jax.model.state import init_state
from gdn_jax.train import (Corpus, Forward, TrainConfig, cast_params, encode, load_corpus, make_optimizer,
                           reference_documents, run_settings, train, train_step_for)
from gdn_jax.tokenizer import ByteTokenizer
from gdn_jax.model.weights import abstract_model, load_hf_weights, save_hf_weights
from tests.gdn_jax.helpers import BLOCK_SIZE, random_ids, single_row_batch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "tools"))
import train_tiny  # noqa: E402

pytestmark = pytest.mark.studies


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny-random")
    graphdef, params = init_model(cfg)
    return cfg, graphdef, params


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-5), (jnp.bfloat16, 0.1)])
def test_training_forward_logits_equal_engine_prefill(tiny, dtype, atol):
    """Same params, same tokens: the dense forward (no cache, chunk 32) gives the engine's prefill logits
    (paged KV cache, chunk 64) at every position; in bfloat16 both cast the same float32 params."""
    cfg, _, params = tiny
    rng = np.random.default_rng(0)
    T = 100  # not a multiple of either chunk size, more than one chunk
    tokens = np.asarray([random_ids(rng, T), random_ids(rng, T)], np.int32)
    fwd = Forward(cfg, dtype)
    dense = np.asarray(jax.jit(fwd.logits)(params, tokens))
    assert dense.shape == (2, T, cfg.vocab_size) and dense.dtype == np.float32
    graphdef, abstract = abstract_model(cfg, dtype)
    engine_params = cast_params(params, abstract)
    nb = -(-T // BLOCK_SIZE)
    step = jax.jit(forward, static_argnums=(0, 4))
    for row in range(2):
        batch = single_row_batch(tokens[row], 0, nb)
        logits, _ = step(graphdef, engine_params, batch, init_state(cfg, nb + 1, BLOCK_SIZE, 2, dtype), True)
        np.testing.assert_allclose(dense[row], np.asarray(logits[0]), atol=atol, rtol=0)
    # and the rows are really different sequences (the comparison is not between constants)
    assert np.abs(dense[0] - dense[1]).max() > 0.1


def _rule_inputs(seed, B=2, T=45, H=2, dk=8, dv=8):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = l2norm(jax.random.normal(ks[0], (B, T, H, dk))) * dk**-0.5
    k = l2norm(jax.random.normal(ks[1], (B, T, H, dk)))
    v = jax.random.normal(ks[2], (B, T, H, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))  # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = 0.3 * jax.random.normal(ks[5], (B, H, dk, dv))
    return q, k, v, g, beta, s0


def _rule_value_and_grad(rule, inputs):
    """Value and gradient wrt (q, k, v, g, beta, initial state) of a loss that weighs every output and the final
    state, so every path of the backward pass counts."""
    wo = jax.random.normal(jax.random.PRNGKey(1), inputs[2].shape)
    ws = jax.random.normal(jax.random.PRNGKey(2), inputs[5].shape)

    def loss(q, k, v, g, beta, s0):
        o, s = rule(q, k, v, g, beta, initial_state=s0)
        return jnp.sum(o * wo) + jnp.sum(s * ws)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))(*inputs)


@pytest.fixture(scope="module")
def recurrent_reference():
    inputs = _rule_inputs(0)
    return inputs, _rule_value_and_grad(recurrent_gated_delta_rule, inputs)


@pytest.mark.parametrize("impl,chunk", [("fused", 16), ("parallel", 16), ("fused", 32)])
def test_chunked_rule_gradient_equals_recurrent_rule_gradient(recurrent_reference, impl, chunk):
    """The gradient through the chunked rule (what training differentiates) equals the gradient through the
    token-by-token rule, for every input including the initial state, within float32 tolerance."""
    inputs, (l_r, g_r) = recurrent_reference
    l_c, g_c = _rule_value_and_grad(
        lambda *a, **kw: chunk_gated_delta_rule(*a, **kw, chunk_size=chunk, impl=impl), inputs)
    np.testing.assert_allclose(float(l_c), float(l_r), rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), g_c, g_r):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 1e-3, name  # a real gradient, not zeros on both sides
        np.testing.assert_allclose(a, b, atol=2e-5 * np.abs(b).max(), rtol=1e-4, err_msg=name)


def test_corpus_split_is_fixed_and_disjoint():
    """The held-out slice is a fixed, line-aligned cut of the reference text; the training stream is exactly the rest
    (documents separated by EOS), so no held-out byte is trained on."""
    corpus = load_corpus(heldout_bytes=4096)
    assert corpus.heldout_text == load_corpus(heldout_bytes=4096).heldout_text
    assert 4096 <= len(corpus.heldout_text) < 4096 + 200 and corpus.heldout_text.endswith("\n")
    text = "\n".join(reference_documents()) + "\n"
    ids = corpus.train
    as_bytes = np.where(ids == ByteTokenizer.EOS, ord("\n"), ids - ByteTokenizer.OFFSET).astype(np.uint8)
    train_text = as_bytes.tobytes().decode()
    assert text.count(corpus.heldout_text) == 1
    assert train_text == text.replace(corpus.heldout_text, "", 1)
    assert corpus.train.min() >= 1 and corpus.train.max() < 260


def _checkpoint_folder(path, step, settings=None):
    """An orbax checkpoint folder whose latest step is `step`, as an earlier run leaves it (what `train` reads of it
    before it trains: the step, and the settings the run recorded)."""
    import orbax.checkpoint as ocp
    items = {"history": ocp.args.JsonSave([{"step": step}])}
    if settings is not None:
        items["run"] = ocp.args.JsonSave(settings)
    with ocp.CheckpointManager(path.absolute()) as mngr:
        mngr.save(step, args=ocp.args.Composite(**items))
        mngr.wait_until_finished()
    return path


def test_a_checkpoint_folder_holding_another_run_is_refused_before_training(tmp_path):
    """A run from scratch into a folder an earlier run checkpointed in would have none of its saves kept (orbax skips
    steps at or below the latest one) and a later resume would continue the earlier run: refused, naming the folder.
    A resume with other settings than the checkpoint's (here the learning rate and the seed) is refused, naming
    them; only the logging, evaluation and checkpoint cadence may change."""
    cfg = get_preset("tiny-random")
    text = "The quick brown fox jumps over the lazy dog.\n" * 20
    corpus = Corpus(encode(text), text[:128], 1, len(text))
    tc = TrainConfig(steps=8, batch=2, seq_len=16, eval_window=16, compute_dtype="float32")
    quiet = dict(log=lambda s: None)
    ckpt = _checkpoint_folder(tmp_path / "a", 4)
    with pytest.raises(ValueError, match=r"holds an earlier run \(latest step 4\): resume it"):
        train(cfg, tc, corpus, ckpt_dir=ckpt, **quiet)
    other = TrainConfig(**{**tc.__dict__, "lr": 1e-3, "seed": 5, "log_every": 1, "ckpt_every": 1})
    ckpt = _checkpoint_folder(tmp_path / "b", 4, run_settings(cfg, other, corpus))
    with pytest.raises(ValueError, match=r"other settings.*: train.lr 0.001 -> 0.003, train.seed 5 -> 0$"):
        train(cfg, tc, corpus, ckpt_dir=ckpt, resume=True, **quiet)
    assert not {"log_every", "eval_every", "ckpt_every"} & set(run_settings(cfg, tc, corpus)["train"])
    # another training stream is another run too
    assert run_settings(cfg, tc, corpus)["corpus"] != run_settings(cfg, tc, Corpus(encode(text[1:]), text[:128], 1, 0))[
        "corpus"]


def test_settings_that_cannot_train_on_the_corpus_are_refused_before_training():
    """A vocabulary that does not hold every byte of the corpus (here up to id 230) gave NaN losses at the first
    batch with such a byte, and an evaluation window longer than the held-out slice failed at the first evaluation,
    after the steps before it: both are ValueErrors naming the setting before anything runs. So is --layers 0 (a
    ZeroDivisionError)."""
    cfg = get_preset("tiny-random")
    text = "Prices in euro: 5\u20ac, the quick brown fox jumps over the lazy dog.\n" * 20
    corpus = Corpus(encode(text), text[:100], 1, len(text.encode()))
    tc = TrainConfig(steps=8, batch=2, seq_len=16, eval_window=16, compute_dtype="float32")
    with pytest.raises(ValueError, match=r"vocab_size 200 .* token id 230"):
        train(dataclasses.replace(cfg, vocab_size=200), tc, corpus, log=lambda s: None)
    with pytest.raises(ValueError, match=r"eval_window 128 .* held-out slice of 10\d tokens"):
        train(cfg, TrainConfig(**{**tc.__dict__, "eval_window": 128}), corpus, log=lambda s: None)
    with pytest.raises(SystemExit):
        train_tiny.parse(["--layers", "0"])


def test_the_model_card_command_trains_the_whole_run():
    """The card shows the command line of the run's last part without the options that only steer that part: a run
    resumed with --stop-after (the interrupt-and-resume workflow) would otherwise show a command that stops early."""
    argv = ["--resume", "--stop-after", "600", "--lr", "1e-3", "--stop-after=5", "--host-note", "shared", "--seed=2"]
    assert train_tiny._shown_args(argv) == ["--lr", "1e-3", "--seed=2"]


def test_the_closing_sample_fits_a_model_with_few_positions(tmp_path):
    """--max-positions below the sample engine's 512 (the training windows' 256, say) failed after the whole run, the
    weights exported but no card written: the sample runs in the positions the model has. Too few for the prompt is an
    argparse error before training, and so is a --vocab below the byte tokenizer's 260 (the engine refused the model
    after training)."""
    cfg = dataclasses.replace(get_preset("tiny-random"), hidden_size=32, intermediate_size=64,
                              max_position_embeddings=64)
    save_hf_weights(tmp_path, cfg, init_model(cfg)[1])
    text = train_tiny.sample(tmp_path, train_tiny.PROMPT)
    assert len(ByteTokenizer(512).encode(train_tiny.PROMPT + text)) <= 64
    with pytest.raises(SystemExit):
        train_tiny.main(["--max-positions", "16", "--out", str(tmp_path / "m"), "--log-dir", str(tmp_path / "l")])
    assert not (tmp_path / "l").exists()  # refused before anything ran
    with pytest.raises(SystemExit):  # trains (the corpus's ids stop at 230) but the engine cannot serve it
        train_tiny.parse(["--vocab", "256"])


MICRO = ["--steps", "24", "--batch", "4", "--seq-len", "64", "--lr", "3e-3", "--warmup", "4", "--eval-every", "12",
         "--ckpt-every", "6", "--log-every", "6", "--hidden", "64", "--intermediate", "128", "--layers", "4",
         "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--linear-head-dim", "16", "--heldout-bytes", "2048",
         "--eval-window", "64", "--max-positions", "512", "--no-sample"]


@pytest.mark.slow
def test_reduced_training_run_lowers_the_loss_and_resumes_at_the_same_step(tmp_path):
    """A micro config, 24 steps: run 1 stops after 12 steps (as an interruption would), run 2 resumes from the
    checkpoint at step 12, finishes, and exports a model folder. The weights equal those of
    an uninterrupted run (the data order depends only on the step)."""
    out, logs = tmp_path / "model", tmp_path / "logs"
    common = MICRO + ["--out", str(out), "--log-dir", str(logs)]
    first = train_tiny.main(common + ["--stop-after", "12"])
    assert (first["start_step"], first["end_step"]) == (0, 12)
    assert not (out / "model.safetensors").exists()  # interrupted: nothing exported
    step = train_step_for(train_tiny.model_config(train_tiny.parse(common)), TrainConfig(steps=24, lr=3e-3, warmup=4))
    traced = jax_compat.compilations([step])
    second = train_tiny.main(common + ["--resume"])
    assert (second["start_step"], second["end_step"]) == (12, 24)
    # the resumed run called the program the first one compiled (orbax's arrays are committed to the device: a
    # fresh run's arrays are too, or the resume traced and compiled its own)
    assert jax_compat.compilations([step]) == traced
    history = json.loads((logs / "loss_curve.json").read_text())["history"]
    assert [r["step"] for r in history] == [6, 12, 18, 24]  # one history across both runs
    sched = make_optimizer(TrainConfig(steps=24, lr=3e-3, warmup=4))[1]  # each row: its last step's rate
    assert [r["lr"] for r in history] == pytest.approx([float(sched(s - 1)) for s in (6, 12, 18, 24)])
    assert history[-1]["loss"] < history[0]["loss"] - 0.3
    assert history[-1]["val_bpb"] < history[1]["val_bpb"]
    assert second["val_bpb"]["float32"] == pytest.approx(history[-1]["val_bpb"], abs=0.02)
    for name in ("config.json", "model.safetensors", "README.md", "validation.txt", "training.json", "loss_curve.png"):
        assert (out / name).is_file(), name
    assert f"{second['val_bpb']['float32']:.4f}" in (out / "README.md").read_text()
    # the folder is this run's: neither a run from scratch nor a resume with another learning rate may take it over
    with pytest.raises(ValueError, match="holds an earlier run"):
        train_tiny.main(common)
    with pytest.raises(ValueError, match=r"train.lr 0.003 -> 0.001"):
        train_tiny.main(common + ["--resume", "--lr", "1e-3"])

    # an uninterrupted run of the same 24 steps ends with the same weights
    args = train_tiny.parse(common)
    tc = TrainConfig(steps=24, batch=4, seq_len=64, lr=3e-3, warmup=4, eval_every=1000, eval_window=64,
                     ckpt_every=10, log_every=1000)
    straight = train(train_tiny.model_config(args), tc, load_corpus(2048), ckpt_dir=tmp_path / "straight",
                     log=lambda s: None)
    # a checkpoint logs the losses since the last row: a resume from step 10 or 20 loses none of them
    assert [r["step"] for r in straight["history"]] == [10, 20, 24]
    assert jax_compat.compilations([step]) == traced
    _, _, exported = load_hf_weights(out)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(exported)), jax.tree.leaves(nnx.to_pure_dict(straight["params"]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
