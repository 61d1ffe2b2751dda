"""Each study script runs end to end in its --quick mode and writes the JSON and plot its README section shows."""

import importlib
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.studies

ROOT = Path(__file__).resolve().parent.parent
# The studies' default model. (Compiling step shapes, not running them, is what the quick studies spend their time on,
# and the trained tiny compiles as fast as tiny-random.) notebooks/02_accuracy_study.ipynb's reduced run, tested in
# the same pytest process, is the quick accuracy study on it too and runs the steps compiled here.
MODEL = "tiny"


def _script(name):
    """The module of scripts/<folder>/<name>.py, or of scripts/common.py: imported from its folder as the command
    runs it (the script puts scripts/ on sys.path for `common` itself)."""
    (path,) = [p for p in (ROOT / "scripts").rglob(f"{name}.py")]
    sys.path.insert(0, str(path.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(path.parent))


@pytest.mark.slow
def test_accuracy_study_shows_exact_equals_no_cache_and_both_unsafe_modes_drift(tmp_path):
    _script("accuracy_study").main(["--quick", "--model", MODEL, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "accuracy_study.json").read_text())
    assert (tmp_path / "accuracy_study.png").stat().st_size > 0
    modes = result["modes"]
    assert set(modes) == {"exact", "unsafe_cold", "unsafe_stale", "ckpt_bfloat16", "ckpt_int8", "ckpt_float8", "spec"}
    exact = modes["exact"]
    assert exact["kl_max"] < 1e-6 and exact["greedy_agreement"] == 1.0 and exact["first_divergence_mean"] is None
    assert exact["max_abs_logprob_diff"] < 1e-4
    for name in ("unsafe_cold", "unsafe_stale"):
        m = modes[name]
        assert m["kl_mean"] > 100 * max(exact["kl_mean"], 1e-9), name
        assert m["max_abs_logprob_diff"] > 1e-2, name
        assert m["mean_cached_tokens"] > exact["mean_cached_tokens"], name  # they reuse more, wrongly
    for name in ("ckpt_bfloat16", "ckpt_int8", "ckpt_float8"):  # compressed checkpoints: reused as exact, rounded
        m = modes[name]
        assert m["mean_cached_tokens"] == exact["mean_cached_tokens"], name
        assert exact["kl_mean"] < m["kl_mean"] < modes["unsafe_cold"]["kl_mean"], name
    # speculative decoding (MTP drafts): exact's reuse and greedy outputs; its teacher-forced pass drafts nothing
    spec = modes["spec"]
    assert spec["greedy_agreement"] == exact["greedy_agreement"] == 1.0 and spec["first_divergence_mean"] is None
    assert spec["mean_cached_tokens"] == exact["mean_cached_tokens"]
    assert spec["mean_prompt_cached_tokens"] == exact["mean_prompt_cached_tokens"]
    assert spec["kl_max"] < 1e-6 and spec["max_abs_logprob_diff"] < 1e-4
    # the trained tiny's MTP block drafts tokens the model accepts (a random model's might accept none)
    assert spec["spec_draft_tokens"] > 0 and 0 < spec["spec_acceptance"] <= 1
    assert spec["spec_acceptance"] == spec["spec_accepted_tokens"] / spec["spec_draft_tokens"]
    assert all(m["spec_acceptance"] is None and m["spec_draft_tokens"] == 0 for n, m in modes.items() if n != "spec")
    assert result["config"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert result["config"]["max_model_len"] == 1024 and result["environment"]["jax"]


@pytest.mark.slow
def test_ttft_study_reports_every_workload_cache_on_and_off(tmp_path):
    _script("ttft_study").main(["--quick", "--model", MODEL, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ttft_study.json").read_text())
    assert (tmp_path / "ttft_study.png").stat().st_size > 0
    rows = {(r["workload"], r["mode"], r["cache"]): r for r in result["rows"]}
    assert len(rows) == 4 * 2 * 2
    for (workload, mode, cache), r in rows.items():
        assert r["ttft_p50_ms"] > 0 and r["ttft_p90_ms"] >= r["ttft_p50_ms"]
        assert r["ttft_p50_ms_per_pass"] == [r["ttft_p50_ms"]]  # --quick: one measured pass
        assert r["counters"]["compilations"] == 0, (workload, mode, cache)  # measured after warm-up
        if cache == "off" or workload == "no sharing":
            assert r["reused_tokens"] == 0
    for workload in ("shared system prompt", "repeats", "multi-turn"):
        assert rows[(workload, "serial", "on")]["hit_rate"] > 0.5 and rows[(workload, "serial", "on")]["reused_tokens"]


@pytest.mark.slow
def test_checkpoint_tradeoff_sweeps_stride_and_capacity(tmp_path):
    _script("checkpoint_tradeoff").main(["--quick", "--model", MODEL, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "checkpoint_tradeoff.json").read_text())
    assert (tmp_path / "checkpoint_tradeoff.png").stat().st_size > 0
    rows = {(r["chunk_stride"], r["capacity_per_seq"]): r for r in result["rows"]}
    assert set(rows) == {(64, 1), (64, 4), (128, 1), (128, 4)}
    for (stride, cap), r in rows.items():
        assert 0 <= r["reused_fraction"] <= 1 and r["checkpoint_bytes"] > 0
        assert r["reuse_lost_total"] >= 0
        assert r["compilations"] == 0, (stride, cap)  # the warm-up pass compiled every shape the measured one runs
    # more checkpoint slots never lose reuse, and cost proportionally more memory
    for stride in (64, 128):
        assert rows[(stride, 4)]["reused_fraction"] >= rows[(stride, 1)]["reused_fraction"]
        assert rows[(stride, 4)]["checkpoint_bytes"] == 4 * rows[(stride, 1)]["checkpoint_bytes"]
        # with one slot, a prefill step crossing several boundaries cannot save the deeper ones
        assert rows[(stride, 1)]["saves_skipped"] > rows[(stride, 4)]["saves_skipped"]
    assert result["conclusion"] and result["environment"]["backend"] == "cpu"


@pytest.mark.parametrize("script, argv, message", [
    ("accuracy_study", ["--seed", "-1"], "argument --seed: -1 is below 0"),
    ("checkpoint_tradeoff", ["--turns", "0"], "argument --turns: 0 is below 1"),
    ("policy_study", ["--policies", "lru,lfu"], "--policies: lfu: expected some of lru, flop_aware, overlap, end_of_turn, lru_int8"),
    ("checkpoint_tradeoff", ["--conversations", "two"], "'two' is not an integer"),
    ("checkpoint_tradeoff", ["--block-size", "48"], "--block-size (48) must divide every chunk_stride of the sweep"),
    ("ttft_study", ["--ab", "--shared", "300", "--prompt", "256"], "--shared (300) must be below --prompt (256)"),
    ("ttft_study", ["--ab", "--prefill"], "pass one"),
    ("ttft_study", ["--prefill", "--quick"], "--quick shrinks the study only"),
    ("ttft_study", ["--rounds", "0"], "argument --rounds: 0 is below 1"),
    # a flag of the other runs is an error, not silently ignored
    ("ttft_study", ["--quick", "--prompt", "512"], "--prompt: for --ab / --prefill"),
    ("ttft_study", ["--quick", "--rounds", "2", "--shared", "100"], "--shared, --rounds: for --ab / --prefill"),
    ("ttft_study", ["--ab", "--model", "tiny", "--prompt", "64", "--shared", "32", "--chunk-stride", "32", "--rounds",
                    "1", "--passes", "2"], "--passes: for the study"),
    ("ttft_study", ["--ab", "--model", "tiny", "--prompt", "64", "--shared", "16", "--chunk-stride", "32"],
     "--shared (16) is below --chunk-stride (32)"),
    # sequences longer than the model's positions name the flags that ask for them (the engine's error named only
    # max_model_len, which the studies size themselves)
    ("accuracy_study", ["--model", "tiny", "--chunk-stride", "2048"],
     "--chunk-stride 2048 and --max-tokens 24: sequences of up to 7808 tokens, beyond the 4096 positions of model"),
    ("ttft_study", ["--prefill", "--model", "tiny-random", "--prompt", "4096", "--shared", "2048"],
     "--prompt 4096 (and 64 tokens of room): sequences of up to 4160 tokens, beyond the 4096 positions"),
    # settings the script fixes itself were named by the engine's words (max_num_batched_tokens, block_size)
    ("ttft_study", ["--prefill", "--model", "tiny-random", "--prompt", "100", "--shared", "50"],
     "--prompt (100) must be at least --chunk-stride (256)"),
    ("ttft_study", ["--ab", "--model", "tiny-random", "--chunk-stride", "250"],
     "--chunk-stride (250) must be a multiple of 16, the KV block size of --ab / --prefill"),
    # --quick has its own workload: the flags were ignored without a word
    ("checkpoint_tradeoff", ["--quick", "--turns", "9", "--block-size", "7"],
     "--quick runs its own small workload: --turns, --block-size would be ignored"),
])
def test_a_bad_option_is_an_error_naming_it_before_anything_runs(script, argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _script(script).main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_out_folder_fails_at_once(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        _script("checkpoint_tradeoff").main(["--quick", "--out", str(tmp_path / "file" / "results")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    # a folder where the study's file goes: found after the whole study, with a traceback
    (tmp_path / "out" / "accuracy_study.json").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        _script("accuracy_study").main(["--quick", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and f"{tmp_path / 'out' / 'accuracy_study.json'} is a folder" in capsys.readouterr().err


def test_the_engine_refusing_a_setting_ends_the_command_with_its_message(tmp_path):
    """From the command line, a setting only the engine can judge (a stride off the block grid) gives one line."""
    import subprocess
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "studies" / "accuracy_study.py"), "--quick", "--model",
                        "tiny-random", "--chunk-stride", "40", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: chunk_stride (40) must be a positive multiple of block_size (16)")


def test_study_json_records_the_environment():
    env = _script("common").environment()
    assert env["backend"] == "cpu" and env["jax"] and env["jaxlib"] and env["cpu_count"] >= 1
    assert env["git_commit"] is None or len(env["git_commit"]) == 40


@pytest.mark.parametrize("stride", [32, 48, 64])
def test_accuracy_workload_prefixes_lie_between_checkpoint_boundaries(stride):
    """Each group's shared prefix passes a boundary without reaching the next, also at strides shorter than the
    text opening it starts with; so does its KV match (whole 16-token blocks): a KV match that ended on the boundary
    would make both unsafe paths the exact one (at stride 32 half the groups' did)."""
    import numpy as np
    from gdn_jax.tokenizer import ByteTokenizer
    study = _script("accuracy_study")
    for seed in range(5):
        items = study.make_workload(512, stride, 6, 2, 1, np.random.default_rng(seed), ByteTokenizer(512))
        for g in range(6):
            a, b = (it["tokens"] for it in items if it["group"] == g)
            shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # (suffixes may share a first token)
            boundary = stride * (1 + g % 3)
            assert boundary < shared // 16 * 16 <= shared < boundary + stride, (stride, seed, g, shared)


def test_accuracy_study_refuses_a_stride_of_one_block(tmp_path, monkeypatch):
    """With chunk_stride = block_size every KV match ends on a checkpoint boundary: unsafe_stale would reuse exactly
    what exact does, and the study would report that it does not drift. Refused before any engine is built."""
    study = _script("accuracy_study")
    monkeypatch.setattr(study, "make_engines", None)
    with pytest.raises(ValueError, match=r"--chunk-stride \(16\) must be at least two KV blocks \(32\)"):
        study.main(["--quick", "--chunk-stride", "16", "--out", str(tmp_path)])


def test_ab_pairs_the_restoring_step_with_the_cache_off_step_at_the_same_position():
    """B's deepest checkpoint (48) is not where the cache-off run's last step starts (96): the A/B compares the
    48-token steps that both start at 48, not a 48-token step with a 32-token one."""
    steps = [{"tokens": 48, "seconds": 1.0}, {"tokens": 48, "seconds": 2.0}, {"tokens": 32, "seconds": 3.0}]
    ttft = _script("ttft_study")
    assert ttft.step_at(steps, 48)["seconds"] == 2.0 and ttft.step_at(steps, 0)["seconds"] == 1.0
    with pytest.raises(ValueError, match="position 50"):
        ttft.step_at(steps, 50)


def test_ttft_study_counters_leave_out_the_evictions_of_its_own_cache_resets():
    """Each measured pass starts from an emptied prefix cache; emptying it evicts the checkpoints of the pass before
    (and of the warm-up), which are not evictions the workload caused: a pool with room for every checkpoint reports
    none."""
    from gdn_jax import LLMEngine
    ttft = _script("ttft_study")
    engine = LLMEngine(MODEL, block_size=16, chunk_stride=32, max_num_seqs=1, max_model_len=128, verbose=False)
    make = lambda r: [[[5 + (r + i) % 200 for i in range(80)]]]  # noqa: E731 - one 80-token prompt per pass
    s = ttft.measured(engine, make, False, 1, passes=2)
    assert s["counters"]["checkpoints_saved"] == 2 * 2  # at 32 and 64, each pass
    assert s["counters"]["checkpoints_evicted"] == 0
    assert engine.cache_stats()["checkpoints_evicted"] == 2 * 2  # the resets' own: warm-up's and first pass's


def test_accuracy_workload_user_turns_follow_the_seed():
    """The user line each continued turn appends is drawn from the workload's seed, like its prompts (it was drawn
    from the result count, so every --seed continued with the same lines)."""
    import types

    import numpy as np
    from gdn_jax.tokenizer import ByteTokenizer
    study = _script("accuracy_study")

    class Recorder:  # stands in for the LLM: answers every prompt with one fixed token, records the prompts
        def __init__(self):
            self.prompts = []

        def generate(self, prompt, params, use_tqdm=False):
            self.prompts.append(prompt["prompt_token_ids"])
            out = types.SimpleNamespace(token_ids=[7])
            metrics = types.SimpleNamespace(spec_draft_tokens=0, spec_accepted_tokens=0)
            return [types.SimpleNamespace(outputs=[out], num_cached_tokens=0, prompt_logprobs=[], metrics=metrics)]

    last_lines = []
    for seed in (0, 1):
        items = study.make_workload(512, 32, 1, 1, 2, np.random.default_rng(seed), ByteTokenizer(512))
        llm = Recorder()
        results = study.run_mode(llm, items, 1)
        assert [r["prompt_len"] for r in results] == [len(items[0]["tokens"]) + k * 13 for k in range(3)]
        turns = results[1]["tf_tokens"], results[2]["tf_tokens"]
        last_lines.append((turns[0][-13:-1], turns[1][-13:-1]))  # the user line before the forced token
    assert last_lines[0] != last_lines[1] and last_lines[0][0] != last_lines[0][1]


def test_the_studies_engines_share_the_accelerators_memory(monkeypatch):
    """The accuracy study builds its engines side by side: the first sizes its pools from its part of the default
    accelerator share (`gpu_memory_utilization` is per engine; spec's larger pools count twice), the others copy its
    pools and ask for no budget (on a GPU a second full share would not fit beside the first). spec's pools hold its
    draft slots beside exact's checkpoint room; a model without an MTP block (tiny-random) runs no spec engine."""
    from gdn_jax.engine import llm_engine
    from gdn_jax.worker.memory import CPU_MEMORY_BUDGET_BYTES, GPU_MEMORY_UTILIZATION

    asked = []

    def budget(params_bytes, gpu_memory_utilization):
        asked.append(gpu_memory_utilization)
        return CPU_MEMORY_BUDGET_BYTES

    monkeypatch.setattr(llm_engine, "default_memory_budget", budget)
    study = _script("accuracy_study")
    assert set(study.modes_of("tiny-random")) == set(study.MODES) - {"spec"}
    engines = study.make_engines("tiny", "float32", 32)
    assert list(engines) == list(study.MODES) and asked == [GPU_MEMORY_UTILIZATION / 9]
    exact, spec = engines["exact"].engine.memory, engines.pop("spec").engine.memory
    assert {(e.engine.memory.num_kv_blocks, e.engine.config.cache.num_linear_slots or e.engine.memory.num_linear_slots)
            for e in engines.values()} == {(exact.num_kv_blocks, exact.num_linear_slots)}
    assert spec.num_kv_blocks == exact.num_kv_blocks and spec.num_draft_slots == 2 * 4  # k per sequence
    assert spec.num_checkpoint_slots == exact.num_checkpoint_slots > 0


def test_accuracy_progress_bar_counts_the_continued_turns(monkeypatch):
    """The bar's total is every request each mode runs, continued turns included (it counted the first turns only,
    so the bar ran past its total)."""
    import types

    import numpy as np
    import tqdm.auto
    from gdn_jax.tokenizer import ByteTokenizer
    study = _script("accuracy_study")

    class Engine:  # answers every prompt with one fixed token
        def generate(self, prompt, params, use_tqdm=False):
            out = types.SimpleNamespace(token_ids=[7])
            metrics = types.SimpleNamespace(spec_draft_tokens=0, spec_accepted_tokens=0)
            return [types.SimpleNamespace(outputs=[out], num_cached_tokens=0, prompt_logprobs=[], metrics=metrics)]

    bars = []

    class Bar:
        def __init__(self, total, **_):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    items = study.make_workload(512, 32, 2, 2, 3, np.random.default_rng(0), ByteTokenizer(512))
    study.run_all({name: Engine() for name in study.MODES}, items, 1)
    assert bars[0].n == bars[0].total == len(study.MODES) * study.num_requests(groups=2, per_group=2, turns=3)


def test_checkpoint_tradeoff_refuses_conversations_longer_than_max_model_len_before_running(monkeypatch):
    """Each turn's prompt holds every earlier answer: a workload whose last turn outgrows max_model_len is an error
    naming the flags that make it so, before a step runs (it failed at that turn, after running the earlier ones)."""
    from gdn_jax import LLMEngine
    study = _script("checkpoint_tradeoff")

    def step(self):
        raise AssertionError("a step ran")

    monkeypatch.setattr(LLMEngine, "step", step)
    sizes = dict(conversations=1, turns=2, max_tokens=100, user_words=(4, 5), block_size=64, max_model_len=320)
    with pytest.raises(ValueError, match=r"--turns 2 and --max-tokens 100 .* max_model_len 320"):
        study.measure(MODEL, "float32", 64, 1, sizes, 0)


def test_accuracy_study_refuses_a_vocabulary_too_large_for_whole_rows_before_building_engines(tmp_path, capsys):
    """The study compares whole log-distributions (`prompt_logprobs=-1`): a model whose vocabulary is too large for
    them is an error naming --model at once (the engine refused the first scoring request, after the four engines were
    built and the reference had begun)."""
    cfg = json.loads((ROOT / "tests" / "fixtures" / "hf_tiny" / "config.json").read_text())
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 70_000}))
    with pytest.raises(SystemExit) as e:
        _script("accuracy_study").main(["--quick", "--model", str(tmp_path / "big"), "--out", str(tmp_path)])
    assert e.value.code == 2
    assert f"--model {tmp_path / 'big'}: a vocabulary of 70000 ids" in capsys.readouterr().err


def test_ttft_workload_words_are_as_many_tokens_as_asked_whatever_the_tokenizer():
    """The TTFT study's prompts (and the shared-prefix lengths its sweep plots) are `n` tokens with a tokenizer whose
    tokens are longer than bytes too: the text was drawn for a byte-level one (about 1.5 bytes per asked token), so a
    tokenizer with a token per word gave a third of them."""
    import numpy as np
    ttft = _script("ttft_study")

    class Words:  # one id per word
        def encode(self, text):
            return [len(w) for w in text.split()]

    for n in (24, 256):
        assert len(ttft._words(np.random.default_rng(0), Words(), n)) == n


@pytest.mark.parametrize("run", ["--ab", "--prefill"])
def test_ttft_ab_and_prefill_record_only_the_settings_that_apply(run, tmp_path, monkeypatch):
    """The A/B and prefill runs write their settings (`args`) into their JSON: passes, a setting of the study alone,
    was written there as 3."""
    ttft = _script("ttft_study")
    monkeypatch.setattr(ttft, run[2:], lambda args: vars(args))
    got = ttft.main([run, "--model", "tiny-random", "--prompt", "64", "--shared", "32", "--chunk-stride", "32",
                     "--out", str(tmp_path)])
    assert "passes" not in got
    assert (got["prompt"], got["shared"], got["rounds"], got["chunk_stride"]) == (64, 32, 3, 32)


def _model_of_positions(tmp_path, positions: int) -> str:
    """tests/fixtures/hf_tiny with `positions` positions."""
    folder = tmp_path / f"positions{positions}"
    folder.mkdir()
    cfg = json.loads((ROOT / "tests" / "fixtures" / "hf_tiny" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    (folder / "model.safetensors").symlink_to(ROOT / "tests" / "fixtures" / "hf_tiny" / "model.safetensors")
    return str(folder)


class _Built(Exception):
    pass


def _max_model_len_asked(study, builder: str, monkeypatch, argv: list[str], *, keyword: bool) -> list[int]:
    """The max_model_len `study.main(argv)` builds its first engine with: `study.<builder>` is replaced by one that
    records it (a keyword argument, or the last positional one) and stops the run."""
    asked = []

    def build(*args, **kw):
        asked.append(kw["max_model_len"] if keyword else args[-1])
        raise _Built

    monkeypatch.setattr(study, builder, build)
    with pytest.raises(_Built):
        study.main(argv)
    return asked


@pytest.mark.parametrize("script", ["ttft_study", "checkpoint_tradeoff"])
def test_a_study_takes_the_positions_of_a_model_that_has_fewer_than_its_max_model_len(script, tmp_path, monkeypatch,
                                                                                        capsys):
    """--quick sizes its engines for 512 tokens: a model of 300 positions (the quick sequences fit them) gets engines
    of max_model_len 300, and the output says so (the engine refused 512, naming max_model_len, a setting no study
    takes)."""
    model = _model_of_positions(tmp_path, 300)
    asked = _max_model_len_asked(_script(script), "LLMEngine", monkeypatch,
                                 ["--quick", "--model", model, "--out", str(tmp_path)], keyword=True)
    assert asked == [300]
    assert f"max_model_len 300: the positions of model {model}, fewer than the study's 512" in capsys.readouterr().out


def test_ttft_study_refuses_a_model_too_short_for_its_sequences(tmp_path, capsys):
    model = _model_of_positions(tmp_path, 256)
    with pytest.raises(SystemExit) as e:
        _script("ttft_study").main(["--quick", "--model", model, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert f"--quick: sequences of up to 284 tokens, beyond the 256 positions of model {model}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _script("ttft_study").main(["--model", model, "--out", str(tmp_path)])
    assert ("the study without --quick (--quick: shorter sequences): sequences of up to 1088 tokens, beyond the 256 "
            "positions") in capsys.readouterr().err


def test_checkpoint_tradeoff_refuses_conversations_longer_than_the_models_positions(tmp_path, monkeypatch):
    from gdn_jax import LLMEngine
    study = _script("checkpoint_tradeoff")
    monkeypatch.setattr(LLMEngine, "step", lambda self: pytest.fail("a step ran"))
    model = _model_of_positions(tmp_path, 200)
    with pytest.raises(ValueError, match=rf"--turns 3 and --max-tokens 8 make a last-turn prompt of \d+ tokens, above "
                                         rf"the 200 positions of model {model}: take fewer turns"):
        study.main(["--quick", "--model", model, "--out", str(tmp_path)])


def test_accuracy_study_takes_the_positions_of_a_model_that_has_fewer_than_its_max_model_len(tmp_path, monkeypatch,
                                                                                              capsys):
    """The quick workload's sequences (304 tokens at the default stride) fit a model of 512 positions: its engines
    get max_model_len 512; the study asked for its fixed 1024 and refused the model, naming sequences of 1024
    tokens that the workload does not make."""
    study = _script("accuracy_study")
    model = _model_of_positions(tmp_path, 512)
    asked = _max_model_len_asked(study, "make_engines", monkeypatch,
                                 ["--quick", "--model", model, "--out", str(tmp_path)], keyword=False)
    assert asked == [512]
    assert f"max_model_len 512: the positions of model {model}, fewer than the study's 1024" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a workload that does not fit is refused as before, naming its flags
        study.main(["--quick", "--model", model, "--chunk-stride", "256", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--chunk-stride 256 and --max-tokens 12: sequences of up to 1024 tokens, beyond the 512 positions" in \
        capsys.readouterr().err


def test_policy_study_compares_eviction_policies_exactly_at_equal_memory(tmp_path):
    """lru and lru_int8 (notebooks/03_policies.ipynb's test runs the other float32 policies of the same quick study
    and checks how their hit rates compare), and the host tier."""
    _script("policy_study").main(["--quick", "--model", MODEL, "--policies", "lru,lru_int8", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "policy_study.json").read_text())
    workloads, tier = result["workloads"], result["host_tier"]
    # the host tier: a checkpoint moved to the host is restored whole, as from the device, and exactly
    assert tier["host_hit_reused_tokens"] == tier["device_hit_reused_tokens"] == tier["prefix_tokens"] == 256
    assert tier["recompute_reused_tokens"] == 0 and tier["exact"]
    assert min(tier[f"{k}_ttft_ms"] for k in ("device_hit", "host_hit", "recompute")) > 0
    assert (tmp_path / "policy_study.png").stat().st_size > 0
    assert set(workloads) == {"chat", "agentic", "fewshot"}
    for name, every in workloads.items():
        assert set(every) == {"lru", "lru_int8"}
        rows = {k: r for k, r in every.items() if r["checkpoint_dtype"] == "float32"}
        assert all(r["exact"] for r in rows.values()), name  # cache on equals off under every float32 policy
        assert len({r["checkpoint_bytes"] for r in rows.values()}) == 1 and rows["lru"]["checkpoint_bytes"] > 0
        # int8 checkpoints: about 4x as many in the bytes of the float32 slots not kept for a step's saves
        int8, lru = every["lru_int8"], rows["lru"]
        assert 0.95 * lru["checkpoint_bytes"] <= int8["checkpoint_bytes"] <= lru["checkpoint_bytes"]
        assert int8["compressed_checkpoints"] >= 3.5 * (lru["checkpoint_slots"] - int8["checkpoint_slots"]) > 0
        assert int8["token_hit_rate"] > 0 and int8["checkpoint_dtype"] == "int8", name
        assert all(0 < r["token_hit_rate"] <= 1 and r["flops_saved"] > 0 and r["ttft_p95_ms"] >= r["ttft_p50_ms"]
                   for r in rows.values()), name
