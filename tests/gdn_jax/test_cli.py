"""The command line (`python -m gdn_jax`, `gdn-jax generate | serve`): every flag of it and of the scripts documents
itself (read from the source), a bad option is one line naming it, and each flag reaches the engine or the server."""

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "scripts").rglob("*.py")) + sorted((ROOT / "gdn_jax").rglob("*.py"))


def _add_argument_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            yield node


@pytest.mark.parametrize("path", [p for p in SOURCES if any(_add_argument_calls(p))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_flag_has_a_help_text(path):
    missing = [ast.unparse(call.args[0]) for call in _add_argument_calls(path)
               if not any(k.arg == "help" and ast.unparse(k.value).strip("'\"") for k in call.keywords)]
    assert not missing, f"{path.name}: flags without help: {missing}"


def test_module_entry_point_names_itself(capsys):
    from gdn_jax.__main__ import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m gdn_jax") and "(default: tiny)" in out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "-1", "x"], "argument --max-tokens: -1 is below 1"),
    (["generate", "--temperature", "-1", "x"], "temperature must be in [0, 1e+06]"),  # checked before a model loads
    (["generate", "--model", "nosuch", "x"], "neither a shipped model"),
    (["serve", "--port", "70000"], "argument --port: 70000 is above 65535"),
    (["serve", "--log-level", "loud"], "invalid choice: 'loud'"),
    (["serve", "--chat-template", "/nonexistent/t.jinja"], "--chat-template /nonexistent/t.jinja"),
    (["generate", "--model", str(ROOT / "tests"), "x"], "no config.json in model folder"),
])
def test_a_bad_option_is_one_line_naming_it(argv, message, capsys):
    from gdn_jax.entrypoints.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def _no_engine(monkeypatch):
    """Makes building an engine fail the test: a serve error that should come before it (and its warm-up)."""
    import gdn_jax.engine

    monkeypatch.setattr(gdn_jax.engine, "LLMEngine", lambda *a, **k: pytest.fail("the engine was built first"))


def test_a_chat_template_that_does_not_parse_is_one_line(tmp_path, capsys, monkeypatch):
    """Named with its flag and file, before the engine and its warm-up (it came after a warm-up of a minute)."""
    from gdn_jax.entrypoints.cli import main
    bad = tmp_path / "t.jinja"
    bad.write_text("{{ messages }}\n{% if %}")
    _no_engine(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--chat-template", str(bad), "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"--chat-template {bad}: the chat template does not parse (line 2): Expected an expression" in err


def test_serve_refuses_a_port_in_use_before_the_engine(capsys, monkeypatch):
    import socket

    from gdn_jax.entrypoints.cli import main
    _no_engine(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", "tiny-random", "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--host 127.0.0.1 --port {port}: cannot listen there" in err


def test_engine_settings_that_would_silently_do_nothing_are_one_line(tmp_path, capsys, monkeypatch):
    """A compilation cache "folder" that is a file (the cache and the CPU kernels were off, with warnings), an empty
    model name (the working directory)."""
    from gdn_jax.entrypoints.cli import main
    (tmp_path / "afile").write_text("")
    for argv, message in (  # (--compilation-cache sets GDN_JAX_CACHE_DIR: monkeypatch restores it afterwards)
            (["--compilation-cache", str(tmp_path / "afile")], f"--compilation-cache {tmp_path / 'afile'}: a file"),
            (["--model", ""], "model must be a preset name, a shipped model's name or a model folder, got ''")):
        monkeypatch.setenv("GDN_JAX_CACHE_DIR", "off")
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model", "tiny-random", *argv, "hi"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, (argv, err)


def test_a_model_folder_without_weights_is_one_line_naming_what_is_missing(tmp_path, capsys):
    from gdn_jax.__main__ import main
    (tmp_path / "config.json").write_text((ROOT / "tests" / "fixtures" / "hf_tiny" / "config.json").read_text())
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"no model.safetensors or model.safetensors.index.json in {tmp_path}" in err


def test_generate_json_is_the_whole_of_stdout(capsys, monkeypatch):
    import json
    from gdn_jax.entrypoints.cli import main
    monkeypatch.setenv("GDN_JAX_CACHE_DIR", "off")
    main(["generate", "--model", "tiny-random", "--max-model-len", "64", "--max-num-seqs", "2", "--json",
          "--max-tokens", "3", "--ignore-eos", "--compilation-cache", "", "The cache"])
    out = json.loads(capsys.readouterr().out)  # the engine's start-up line went to stderr
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length" and out["logprobs"] is None
    assert out["prompt_tokens"] == len(b"The cache") and out["e2e_s"] >= out["ttft_s"] > 0


def test_a_corrupt_tokenizer_config_is_one_line_naming_the_file(tmp_path, capsys):
    import shutil

    from gdn_jax.entrypoints.cli import main
    folder = tmp_path / "m"
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf_tiny", folder)
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}",')
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(folder), "--port", "0", "--no-warm-up"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"{folder / 'tokenizer_config.json'}: not valid JSON" in err


def test_serve_flags_reach_the_engine_and_the_server(monkeypatch, tmp_path):
    """Each engine and server flag of `python -m gdn_jax serve` arrives where it acts (an engine and a server that
    record what they get). The model name resolves as the engine resolves it: the shipped `tiny` (no chat template),
    not a folder of that name in the working directory."""
    import gdn_jax.engine
    from gdn_jax.config import EngineConfig
    from gdn_jax.entrypoints.openai import api_server
    from gdn_jax.entrypoints.cli import main

    seen = {}

    class Engine:
        def __init__(self, config):
            seen["engine"] = config

        def warm_up(self, prompt_logprobs=False):
            seen["warm_up"] = prompt_logprobs
            return 1

    monkeypatch.setattr(gdn_jax.engine, "LLMEngine", Engine)
    monkeypatch.setattr(api_server, "serve", lambda engine, config, **kw: seen.update(config=config, **kw))
    monkeypatch.setenv("GDN_JAX_CACHE_DIR", "unchanged")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "chat_template.jinja").write_text("not the shipped model's")
    main(["serve", "--dtype", "bfloat16", "--seed", "3", "--max-model-len", "512", "--max-num-seqs", "3",
          "--block-size", "32", "--chunk-stride", "128", "--checkpoint-mode", "promote", "--checkpoint-policy", "last",
          "--no-prefix-caching", "--num-kv-blocks", "99", "--num-linear-slots", "20", "--compilation-cache", "",
          "--max-num-batched-tokens", "256", "--no-mixed-steps", "--gdn-schedule", "parallel",
          "--gpu-memory-utilization", "0.5", "--generation-config", "vllm",
          "--host", "0.0.0.0", "--port", "8123", "--api-key", "k", "--served-model-name", "m",
          "--max-tokens-limit", "4096", "--max-request-bytes", "5000", "--warm-up-prompt-logprobs",
          "--log-level", "debug", "--reasoning-parser", "qwen3"])
    assert seen["engine"] == EngineConfig.create(
        model="tiny", dtype="bfloat16", seed=3, enable_prefix_caching=False, block_size=32, chunk_stride=128,
        max_num_seqs=3, max_model_len=512, num_kv_blocks=99, num_linear_slots=20, checkpoint_mode="promote",
        checkpoint_policy="last", max_num_batched_tokens=256, mixed_steps=False, gdn_schedule="parallel",
        generation_config="vllm", gpu_memory_utilization=0.5, compilation_cache_dir="")
    # the cache folder reaches the engine's config; the environment stays as it was
    assert seen["warm_up"] is True and os.environ["GDN_JAX_CACHE_DIR"] == "unchanged"
    config = seen["config"]
    assert (config.model_name, config.api_key, config.max_request_bytes) == ("m", "k", 5000)
    assert config.max_tokens_limit == 512  # no more than fits the context
    assert config.chat_template is None and config.special_tokens == {} and config.reasoning_parser == "qwen3"
    assert (seen["host"], seen["port"], seen["log_level"]) == ("0.0.0.0", 8123, "debug")
    seen.clear()
    main(["serve", "--no-warm-up"])  # unset flags: the engine's own defaults, but a context of 2048 tokens
    assert seen["engine"] == EngineConfig.create(max_model_len=2048) and "warm_up" not in seen
    main(["serve", "--no-warm-up", "--no-enable-prefix-caching", "--no-mixed-steps", "--mixed-steps"])
    assert not seen["engine"].cache.enable_prefix_caching and seen["engine"].scheduling.mixed_steps


def test_generate_takes_the_models_recommended_sampling_for_what_its_flags_leave_unset(monkeypatch, capsys):
    """`gdn-jax generate` honours --generation-config as the server does: the model folder's generation_config.json
    sampling fields fill what the command line leaves unset (greedy where the model recommends nothing), and its
    max_new_tokens caps --max-tokens; with --generation-config vllm the engine reports no such defaults."""
    import types

    import gdn_jax.engine
    from gdn_jax.entrypoints.cli import main

    seen = []

    class FakeLLM:
        def __init__(self, config):
            recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "max_tokens": 8}
            self.engine = types.SimpleNamespace(
                default_sampling=recommended if config.generation_config == "auto" else {})

        def generate(self, prompt, params, use_tqdm=True):
            seen.append(params)
            comp = types.SimpleNamespace(text="", token_ids=[], finish_reason="length", stop_reason=None, logprobs=None)
            return [types.SimpleNamespace(outputs=[comp], metrics=types.SimpleNamespace(ttft=0.0, finished_time=None),
                                          prompt_token_ids=[1], num_cached_tokens=0, error=None)]

    monkeypatch.setattr(gdn_jax.engine, "LLM", FakeLLM)
    main(["generate", "x"])
    main(["generate", "--temperature", "0.8", "--top-k", "5", "--max-tokens", "4", "x"])
    main(["generate", "--generation-config", "vllm", "x"])
    capsys.readouterr()
    got = [(p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) for p in seen]
    assert got == [(0.6, 0.95, 20, 0.05, 8), (0.8, 0.95, 5, 0.05, 4), (0.0, 1.0, -1, 0.0, 32)]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_generate_whose_step_failed_says_so_in_one_line(monkeypatch, capsys, json_flag):
    """A request that a failed device step ended (finish_reason "error", no first token) is an exit naming the error,
    not a TypeError from its missing TTFT nor an empty completion printed as if it had succeeded."""
    import types

    import gdn_jax.engine
    from gdn_jax.entrypoints.cli import main

    class FailingLLM:
        def __init__(self, model, **kw):
            self.engine = types.SimpleNamespace(default_sampling={})

        def generate(self, prompt, params, use_tqdm=True):
            comp = types.SimpleNamespace(text="", token_ids=[], finish_reason="error", stop_reason=None, logprobs=None)
            metrics = types.SimpleNamespace(ttft=None, finished_time=2.0, arrival_time=1.0)
            return [types.SimpleNamespace(outputs=[comp], metrics=metrics, prompt_token_ids=[1], num_cached_tokens=0,
                                          error="RuntimeError: RESOURCE_EXHAUSTED: out of memory")]

    monkeypatch.setattr(gdn_jax.engine, "LLM", FailingLLM)
    with pytest.raises(SystemExit) as e:
        main(["generate", *json_flag, "x"])
    captured = capsys.readouterr()
    assert e.value.code not in (0, None) and captured.out == ""
    assert "RESOURCE_EXHAUSTED: out of memory" in str(e.value.code)


def test_a_cache_folder_variable_naming_a_file_is_an_error(tmp_path, monkeypatch):
    """GDN_JAX_CACHE_DIR naming a file: JAX warned and compiled everything at every start."""
    import jax

    from gdn_jax.worker.compile_cache import enable_compilation_cache
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("GDN_JAX_CACHE_DIR", str(tmp_path / "f"))
    before = jax.config.jax_compilation_cache_dir  # (the suite's own folder, set by conftest)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with pytest.raises(ValueError, match=f"the compilation cache folder {tmp_path / 'f'} .* is a file"):
            enable_compilation_cache()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_tune_measures_again_and_keeps_the_choices_where_engines_read_them(tmp_path):
    """`gdn-jax tune` measures again over the kept choices (a planted entry goes) and an engine reads what it kept."""
    import json
    import subprocess
    import sys

    child = f"""
import json, sys
from gdn_jax.entrypoints.cli import main
from gdn_jax.backends.cpu import tuning
from gdn_jax.worker.compile_cache import enable_compilation_cache
enable_compilation_cache({str(tmp_path)!r})
path = tuning.choices_file()
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps({{tuning.choice_key("decode_vector_bits float32"): {{"measured": "then", "value": 512}}}}))
main(["tune", "--dtypes", "float32", "--compilation-cache", {str(tmp_path)!r}])
kept = json.loads(path.read_text())
print("KEPT", json.dumps({{k.split(" jax=")[0]: v for k, v in kept.items()}}))
print("RESOLVED", tuning.resolve_forms("float32").decode_vector_bits)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDN_JAX_")}
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("KEPT", "RESOLVED")))
    kept = json.loads(lines["KEPT"])
    measured = kept["decode_vector_bits float32"]
    assert measured["measured"] != "then" and measured["value"] in (256, 512)  # measured again, not the planted one
    assert int(lines["RESOLVED"]) == measured["value"]
    assert "float32: Forms(cpu=True" in run.stdout


def test_speculative_config_flag_reaches_the_engine_and_a_bad_one_is_one_line(monkeypatch, capsys):
    """`--speculative-config JSON` (vLLM's flag and keys), of serve and generate, is EngineConfig.speculative_config;
    --help shows it; a value the engine refuses (another method, text that is not JSON, a bad count, an unknown key)
    is one line naming speculative_config, before an engine is built."""
    import types

    import gdn_jax.engine
    from gdn_jax.config import EngineConfig, SpeculativeConfig
    from gdn_jax.entrypoints.openai import api_server
    from gdn_jax.entrypoints.cli import main

    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and "--speculative-config" in out and "num_speculative_tokens" in out

    seen = {}

    class Engine:
        def __init__(self, config):
            seen["engine"] = config

    class FakeLLM(Engine):
        engine = types.SimpleNamespace(default_sampling={})

        def generate(self, prompt, params, use_tqdm=True):
            comp = types.SimpleNamespace(text="", token_ids=[], finish_reason="length", stop_reason=None, logprobs=None)
            return [types.SimpleNamespace(outputs=[comp], metrics=types.SimpleNamespace(ttft=0.0, finished_time=None),
                                          prompt_token_ids=[1], num_cached_tokens=0, error=None)]

    monkeypatch.setattr(gdn_jax.engine, "LLMEngine", Engine)
    monkeypatch.setattr(gdn_jax.engine, "LLM", FakeLLM)
    monkeypatch.setattr(api_server, "serve", lambda engine, config, **kw: None)
    for argv in (["serve", "--no-warm-up", "--port", "0", "--speculative-config", spec],
                 ["generate", "--speculative-config", spec, "x"]):
        seen.clear()
        main(argv)
        got = seen["engine"].speculative_config
        assert got == SpeculativeConfig(method="mtp", num_speculative_tokens=2), argv
        assert got.num_speculative_tokens == 2
    main(["generate", "x"])
    assert seen["engine"].speculative_config is None
    capsys.readouterr()

    monkeypatch.setattr(gdn_jax.engine, "LLMEngine", lambda *a, **k: pytest.fail("the engine was built first"))
    monkeypatch.setattr(gdn_jax.engine, "LLM", lambda *a, **k: pytest.fail("the engine was built first"))
    for value, message in (('{"method": "ngram"}', "speculative_config: method must be 'mtp'"),
                           ("not json", "speculative_config: not JSON"),
                           ('{"method": "mtp", "num_speculative_tokens": 0}',
                            "speculative_config: num_speculative_tokens must be an int in [1, 8], got 0"),
                           ('{"num_speculative_tokens": 2, "k": 1}', "speculative_config: unknown key(s) ['k']"),
                           ("[2]", "speculative_config must be a dict")):
        for command, rest in (("serve", ["--port", "0"]), ("generate", ["x"])):
            with pytest.raises(SystemExit) as e:
                main([command, "--speculative-config", value, *rest])
            err = capsys.readouterr().err
            assert e.value.code == 2 and message in err and "Traceback" not in err, (command, value, err)
            assert err.strip().splitlines()[-1].startswith(f"gdn-jax {command}: error: speculative_config")
    assert EngineConfig.create(speculative_config=spec).speculative_config.num_speculative_tokens == 2
