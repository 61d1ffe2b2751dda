"""EngineConfig: every setting declared once (default, doc, check), taken by flat name, and the command line's
engine flags generated from it."""

import argparse

import pytest

from gdn_jax.config import SETTINGS, CacheConfig, EngineConfig, setting_fields
from gdn_jax.entrypoints.cli import add_engine_args, engine_config

pytestmark = pytest.mark.startup


def test_flat_settings_land_in_their_sub_configs_and_round_trip():
    config = EngineConfig.create(model="tiny-random", chunk_stride=128, max_num_seqs=8, gdn_schedule="fused")
    assert config.cache.chunk_stride == 128 and config.scheduling.max_num_seqs == 8
    assert config.compile.gdn_schedule == "fused" and config.model == "tiny-random"
    assert EngineConfig.create(**config.settings()) == config
    assert config.replace(max_num_seqs=2).scheduling.max_num_seqs == 2 and config.scheduling.max_num_seqs == 8
    assert hash(config) == hash(EngineConfig.create(**config.settings()))  # frozen, hashable
    assert EngineConfig(cache=CacheConfig(block_size=32, chunk_stride=64)).settings()["block_size"] == 32


def test_the_token_budget_defaults_to_the_larger_of_the_stride_and_2048():
    assert EngineConfig.create().token_budget == 2048
    assert EngineConfig.create(chunk_stride=4096).token_budget == 4096
    assert EngineConfig.create(max_num_batched_tokens=256).token_budget == 256


@pytest.mark.parametrize("settings, message", [
    ({"chunk_strid": 64}, r"unknown engine setting\(s\) 'chunk_strid'; the settings are EngineConfig's fields: "),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({"max_num_seqs": 2.0}, r"max_num_seqs must be an int, got 2.0 \(float\)"),
    ({"checkpoint_mode": "eager"}, r"checkpoint_mode must be one of \('scan', 'promote'\), got 'eager'"),
    ({"unsafe_reuse": "warm"}, r"unsafe_reuse must be one of \(None, 'cold', 'stale'\), got 'warm'"),
    ({"unsafe_reuse": "cold", "enable_prefix_caching": False}, "unsafe_reuse needs enable_prefix_caching=True"),
    ({"max_num_batched_tokens": 32}, r"max_num_batched_tokens \(32\) must be >= chunk_stride \(64\)"),
    ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
    ({"compilation_cache_dir": 1}, "compilation_cache_dir must be a str or None, got 1"),
    ({"verbose": "no"}, "verbose must be a bool, got 'no'"),
    ({"max_seqs_per_request": 0}, "max_seqs_per_request must be >= 1, got 0"),
    ({"max_waiting_sequences": 0}, "max_waiting_sequences must be >= 1, got 0"),
    ({"max_waiting_sequences": 1.5}, r"max_waiting_sequences must be an int, got 1.5 \(float\)"),
])
def test_a_bad_setting_is_named_before_any_model_loads(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**settings)


def test_a_request_past_the_per_request_or_the_waiting_bound_is_refused_by_name():
    """n above max_seqs_per_request (or above max_waiting_sequences: it could never be queued) is a ValueError; a
    request that would take the waiting sequences past max_waiting_sequences is EngineFull, and nothing of it is
    added."""
    from gdn_jax import LLMEngine, SamplingParams
    from gdn_jax.engine import EngineFull

    assert EngineConfig.create().scheduling.max_seqs_per_request == 256
    assert EngineConfig.create().scheduling.max_waiting_sequences is None
    engine = LLMEngine("tiny-random", max_model_len=64, max_num_seqs=2, max_seqs_per_request=8,
                       max_waiting_sequences=6, verbose=False)
    with pytest.raises(ValueError, match=r"n=9: a request may add at most 8 sequences \(max_seqs_per_request=8\)"):
        engine.add_request("a", [5, 6, 7], SamplingParams(n=9))
    with pytest.raises(ValueError, match=r"n=7: a request may add at most 6 sequences \(max_waiting_sequences=6\)"):
        engine.add_request("a", [5, 6, 7], SamplingParams(n=7))
    engine.add_request("a", [5, 6, 7], SamplingParams(n=4, max_tokens=1))
    with pytest.raises(EngineFull, match="4 sequences wait to run and the request adds 3, past "
                                         "max_waiting_sequences=6") as full:
        engine.add_request("b", [5, 6, 7], SamplingParams(n=3, max_tokens=1))
    assert (full.value.num_waiting, full.value.num_new, full.value.max_waiting_sequences) == (4, 3, 6)
    assert engine.get_num_unfinished_requests() == 1 and len(engine.scheduler.seqs) == 4
    engine.add_request("b", [5, 6, 7], SamplingParams(n=2, max_tokens=1))  # exactly full
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests()


def test_an_engine_refuses_an_unknown_keyword_by_name():
    from gdn_jax import LLM, LLMEngine

    with pytest.raises(ValueError, match=r"unknown engine setting\(s\) 'max_num_seq'"):
        LLM("tiny-random", max_num_seq=4)
    with pytest.raises(ValueError, match="the model is given twice"):
        LLMEngine("tiny-random", model="tiny")


def test_every_setting_has_a_doc_and_one_flat_name():
    fields = setting_fields()
    assert [f.name for f, _ in fields] == list(SETTINGS)
    assert all(f.metadata["help"] for f, _ in fields)


def _parsed(argv, **defaults):
    ap = argparse.ArgumentParser()
    add_engine_args(ap, defaults=defaults)
    return ap.parse_args(argv)


def test_the_flags_are_the_settings_with_their_defaults():
    """Unset flags give the settings' own defaults (one changed by the command), so the CLI restates none."""
    args = _parsed([], max_model_len=2048)
    assert engine_config(args) == EngineConfig.create(max_model_len=2048)
    flags = {f.name for f, _ in setting_fields() if f.metadata.get("cli") is not False}
    assert flags == set(vars(args)) and {"verbose", "unsafe_reuse"}.isdisjoint(flags)


def test_each_flag_reaches_its_setting():
    args = _parsed(["--model", "tiny-random", "--dtype", "bfloat16", "--seed", "7", "--no-prefix-caching",
                    "--block-size", "32", "--chunk-stride", "64", "--checkpoint-policy", "last",
                    "--memory-budget-bytes", "1000000", "--gpu-memory-utilization", "0.5", "--no-mixed-steps",
                    "--max-num-batched-tokens", "512", "--gdn-schedule", "parallel", "--compilation-cache", "/x"])
    want = {"model": "tiny-random", "dtype": "bfloat16", "seed": 7, "enable_prefix_caching": False, "block_size": 32,
            "chunk_stride": 64, "checkpoint_policy": "last", "memory_budget_bytes": 1000000,
            "gpu_memory_utilization": 0.5, "mixed_steps": False, "max_num_batched_tokens": 512,
            "gdn_schedule": "parallel", "compilation_cache_dir": "/x"}
    settings = engine_config(args).settings()
    assert {name: settings[name] for name in want} == want
    assert engine_config(_parsed(["--no-enable-prefix-caching"])).cache.enable_prefix_caching is False
    assert engine_config(_parsed(["--no-mixed-steps", "--mixed-steps"])).scheduling.mixed_steps is True


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is below 1"),
    (["--checkpoint-mode", "eager"], "argument --checkpoint-mode: invalid choice: 'eager'"),
])
def test_a_bad_flag_is_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parsed(argv)
    assert message in capsys.readouterr().err
