"""The `gdn-jax` console command: `gdn-jax serve` (OpenAI-compatible server) and `gdn-jax generate` (one prompt)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from gdn_jax import envs
from gdn_jax.config import SETTINGS, EngineConfig, setting_fields, setting_type
from gdn_jax.entrypoints.openai.server_config import ServerConfig


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as it is written, and "(default: X)" after each flag whose default is a value (a default of
    None or False means "unset" or "off", which the help text says in words)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_in(text: str, lo: int, hi: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < lo or (hi is not None and value > hi):
        raise argparse.ArgumentTypeError(f"{value} is below {lo}" if value < lo else f"{value} is above {hi}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_in(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_in(text, 0)


def _number(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):  # nan passes every comparison
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'positive' if positive else 'nonnegative'} finite "
                                         f"number")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return _number(text, True)


def nonnegative_number(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _number(text, False)


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, e.g. "1,4,16"."""
    return [_int_in(item, 1) for item in text.split(",")]


def writable_file(path: Path) -> str | None:
    """Why `path` cannot be written as a file (None: it can): tried now, by creating its folder and opening it for
    appending (a file this creates is removed again), so that a run fails before its work, not after it. Permission
    bits alone would not tell (root passes os.access on a read-only file system's files)."""
    if path.is_dir():
        return "is a folder"
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    if not existed:
        path.unlink()
    return None


def output_file(text: str) -> str:
    """An argparse type: a file path a benchmark writes at its end, checked writable now (`writable_file`)."""
    problem = writable_file(Path(text))
    if problem:
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return text


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    return _int_in(text, 0, 65535)


class _BoolSetting(argparse.Action):
    """A bool setting's flags: `--x` turns it on; `--no-x`, and an alias that starts with "--no-", turn it off."""

    def __init__(self, option_strings, dest, default=None, help=None):
        on = [o for o in option_strings if not o.startswith("--no-")]
        names = on + ["--no-" + o[2:] for o in on] + [o for o in option_strings if o.startswith("--no-")]
        super().__init__(names, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings[:2])


def add_engine_args(ap: argparse.ArgumentParser, defaults: dict | None = None, only=None) -> None:
    """A flag for each of EngineConfig's settings (`only`: for these alone), generated from its field: the name
    (`max_num_seqs`: `--max-num-seqs`, unless the field names its flag), the type (an int checked against its
    minimum, a number, a Literal's choices, a bool's `--x` / `--no-x`), the default (`defaults` may change some) and
    the doc, as its help. Settings marked `cli=False` get none. `engine_config(args)` reads them back."""
    for field, hint in setting_fields():
        if field.metadata.get("cli") is False or (only is not None and field.name not in only):
            continue
        flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
        names = [flag, *field.metadata.get("aliases", ())]
        doc = field.metadata["help"].replace("%", "%%")  # (argparse formats help with %)
        kw = dict(dest=field.name, default=(defaults or {}).get(field.name, field.default))
        kind, _, choices = setting_type(hint)
        if kind is bool and choices is None:
            ap.add_argument(*names, action=_BoolSetting, help=doc, **kw)
            continue
        if choices is not None:
            kw["choices"] = list(choices)
        elif kind is int:
            kw["type"] = {1: positive_int, 0: nonnegative_int}.get(field.metadata.get("min"), int)
        elif kind is float:
            kw["type"] = float
        ap.add_argument(*names, metavar=None if choices else flag[2:].upper().replace("-", "_"), help=doc, **kw)


def engine_config(args, **settings) -> EngineConfig:
    """The EngineConfig of the flags `add_engine_args` added, and of `settings`."""
    cache_dir = getattr(args, "compilation_cache_dir", None)
    if cache_dir and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
        # (JAX would warn, and run without the cache and without the CPU kernels built beside it)
        raise ValueError(f"--compilation-cache {cache_dir}: a file, not a folder")
    given = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    return EngineConfig.create(**given, **settings)


def _check_address(host: str, port: int) -> None:
    """A ValueError naming --host / --port if the server could not listen there (a name that does not resolve, an
    address of another machine, a port in use), found by binding a socket as the server will (SO_REUSEADDR) and
    closing it at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def _serve(args) -> None:
    try:
        from gdn_jax.entrypoints.openai.api_server import serve
    except ImportError as e:
        sys.exit(f"gdn-jax serve needs the server extra: pip install 'gdn-jax[serve]' ({e})")
    from gdn_jax.chat import ChatTemplate, load_special_tokens
    from gdn_jax.engine import LLMEngine
    from gdn_jax.model.weights import model_folder
    from gdn_jax import distributed
    if distributed.settings() is not None:
        raise ValueError("gdn-jax serve runs on one process: its requests would reach only this one (unset "
                         "GDN_JAX_COORDINATOR_ADDRESS; several hosts run offline, gdn_jax.distributed)")
    settings = engine_config(args)
    folder = model_folder(settings.model)  # as the engine resolves it: a shipped model wins over a same-named folder
    # before the engine: a bad template or address fails at once, not after a warm-up of minutes
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
            ChatTemplate(template)  # compiled once here, for its error
        except OSError as e:
            raise ValueError(f"--chat-template {args.chat_template}: {e.strerror or e}") from None
        except ValueError as e:  # a template that does not parse, or a file that is not UTF-8 text
            raise ValueError(f"--chat-template {args.chat_template}: {e}") from None
    else:
        chat = ChatTemplate.from_folder(folder)  # its error names the folder's file
        template = None if chat is None else chat.source
    _check_address(args.host, args.port)
    special_tokens = load_special_tokens(folder)  # the template's bos_token, eos_token, ...: the tokenizer's
    config = ServerConfig(model_name=args.served_model_name or args.model,
                          api_key=args.api_key or envs.get("GDN_JAX_API_KEY") or None,
                          max_request_bytes=args.max_request_bytes,
                          max_tokens_limit=min(args.max_tokens_limit, settings.scheduling.max_model_len),
                          max_sequences_per_request=args.max_sequences_per_request,
                          max_waiting_sequences=args.server_max_waiting_sequences,
                          stream_timeout=args.stream_timeout, header_timeout=args.header_timeout,
                          body_timeout=args.body_timeout, keep_alive_timeout=args.keep_alive_timeout,
                          shutdown_timeout=args.shutdown_timeout,
                          chat_template=template, special_tokens=special_tokens,
                          reasoning_parser=args.reasoning_parser)
    engine = LLMEngine(settings)
    if not args.no_warm_up:
        t0 = time.perf_counter()
        n = engine.warm_up(prompt_logprobs=args.warm_up_prompt_logprobs)
        print(f"[gdn_jax] warm-up compiled {n} step shapes in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"[gdn_jax] serving {config.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    serve(engine, config, host=args.host, port=args.port, log_level=args.log_level)


def _generate(args) -> None:
    from gdn_jax.engine import LLM
    from scheduler import SamplingParams
    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
             if v is not None}
    fixed = dict(seed=args.seed_sampling, stop=args.stop or None, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    SamplingParams(**{"temperature": 0.0, **given, **fixed}, max_tokens=args.max_tokens)  # checked before loading
    settings = engine_config(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    from gdn_jax import distributed
    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    llm = LLM(settings)
    # as the server: the model's recommended sampling (--generation-config auto) for what the flags leave unset,
    # greedy where it recommends nothing, and its max_new_tokens as a cap
    model = llm.engine.default_sampling
    params = SamplingParams(**{"temperature": 0.0, **model, **given, **fixed,
                               "max_tokens": min(args.max_tokens, model.get("max_tokens", args.max_tokens))})
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    comp, m = out.outputs[0], out.metrics
    if out.error is not None:  # a device step failed (the engine warned): no completion to print
        sys.exit(f"gdn-jax generate: the request failed: {out.error}")
    if args.json:  # stdout holds the JSON alone (the engine's start-up line goes to stderr)
        print(json.dumps({"text": comp.text, "token_ids": comp.token_ids, "finish_reason": comp.finish_reason,
                          "stop_reason": comp.stop_reason, "prompt_tokens": len(out.prompt_token_ids),
                          "cached_tokens": out.num_cached_tokens, "ttft_s": m.ttft,
                          "e2e_s": None if m.finished_time is None else m.finished_time - m.arrival_time,
                          "logprobs": None if comp.logprobs is None else
                          [{str(k): v.logprob for k, v in e.items()} for e in comp.logprobs]}))
    else:
        print(comp.text)
        print(f"[{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}, "
              f"ttft {1e3 * out.metrics.ttft:.0f} ms (compilation included)]", file=sys.stderr)


def _tune(args) -> None:
    """Measures this machine's CPU choices again and keeps them beside the compilation cache."""
    from gdn_jax.backends.cpu.tuning import choices_file, measure_again
    from gdn_jax.worker.compile_cache import enable_compilation_cache

    folder = enable_compilation_cache(args.compilation_cache)
    if folder is None:
        raise ValueError("--compilation-cache off: the measured choices are kept in the cache folder, so there "
                         "would be nowhere to keep them")
    for dtype, forms in measure_again(args.dtypes).items():
        print(f"{dtype}: {forms}")
    print(f"[gdn_jax] kept in {choices_file()}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="gdn-jax", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", formatter_class=HelpFormatter,
                       help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
                            "/health, /metrics)")
    add_engine_args(s, defaults={"max_model_len": 2048})
    s.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: loopback only)")
    s.add_argument("--port", type=port, default=8000, help="TCP port")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                                                   "(or set GDN_JAX_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="model id reported to clients (default: --model)")
    s.add_argument("--max-tokens-limit", type=positive_int, default=ServerConfig.max_tokens_limit,
                   help="largest max_tokens a request may ask for")
    s.add_argument("--max-request-bytes", type=positive_int, default=ServerConfig.max_request_bytes,
                   help="largest request body accepted")
    s.add_argument("--max-sequences-per-request", type=positive_int, default=ServerConfig.max_sequences_per_request,
                   help="most sequences (prompts x n) one request may add; more is a 400")
    # (its own dest: engine_config reads every engine setting's name from args, and the engine's setting of that
    # name stays unset under the server, which bounds the HTTP requests it submits)
    s.add_argument("--max-waiting-sequences", type=positive_int, default=ServerConfig.max_waiting_sequences,
                   dest="server_max_waiting_sequences",
                   help="most sequences submitted and not yet started; a request past it gets a 429 with "
                        "Retry-After")
    s.add_argument("--stream-timeout", type=positive_number, default=ServerConfig.stream_timeout,
                   help="seconds a client may leave a response unread before it is dropped and its requests "
                        "aborted")
    s.add_argument("--header-timeout", type=positive_number, default=ServerConfig.header_timeout,
                   help="seconds from a request's first byte to the end of its headers; then the connection closes")
    s.add_argument("--body-timeout", type=positive_number, default=ServerConfig.body_timeout,
                   help="seconds from the end of a request's headers to the end of its body; then a 408")
    s.add_argument("--keep-alive-timeout", type=positive_number, default=ServerConfig.keep_alive_timeout,
                   help="seconds a connection may stay idle (before its first request too)")
    s.add_argument("--shutdown-timeout", type=positive_number, default=ServerConfig.shutdown_timeout,
                   help="seconds running requests have to finish after SIGTERM or Ctrl-C; then they end with an "
                        "error (a stream's last event before data: [DONE])")
    s.add_argument("--chat-template", default=None, help="jinja chat template file (default: the model folder's)")
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3"],
                   help="chat replies' <think> block goes to the message's `reasoning`, the rest to `content` "
                        "(Qwen3 / Qwen3.5)")
    s.add_argument("--no-warm-up", action="store_true", help="compile step shapes lazily instead of at start-up")
    s.add_argument("--warm-up-prompt-logprobs", action="store_true",
                   help="also compile the prompt-logprobs (echo + logprobs) prefill variant at start-up")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn and server log level")

    g = sub.add_parser("generate", formatter_class=HelpFormatter,
                       help="generate a completion for one prompt and print it")
    add_engine_args(g)
    g.add_argument("prompt", help="prompt text ('-': read it from standard input)")
    g.add_argument("--max-tokens", type=positive_int, default=32,
                   help="tokens to generate (at most the model's generation_config.json max_new_tokens)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the model's generation_config.json value, else 0)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass, 1: off (default: the model's generation_config.json value, else 1)")
    g.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens, -1: off (default: the model's generation_config.json "
                        "value, else -1)")
    g.add_argument("--seed-sampling", type=int, default=None, help="sampling seed of the request")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (in the --json output)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--json", action="store_true", help="print the output as JSON")
    g.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0, to run on several hosts with --tensor-parallel-size over all their "
                        "devices (default: $GDN_JAX_COORDINATOR_ADDRESS; unset: one process)")
    g.add_argument("--num-processes", type=positive_int, default=None,
                   help="processes taking part (default: $GDN_JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=nonnegative_int, default=None,
                   help="this process's index, from 0 (default: $GDN_JAX_PROCESS_ID)")

    t = sub.add_parser("tune", formatter_class=HelpFormatter,
                       help="measure this machine's CPU choices again (product forms, decode vector width) and keep "
                            "them; engines read them at start and never measure while tracing")
    t.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="the activation dtypes to measure for")
    t.add_argument("--compilation-cache", default=None,
                   help="the cache folder the choices are kept in (default: GDN_JAX_CACHE_DIR or the user's cache)")

    args = ap.parse_args(argv)
    try:
        {"serve": _serve, "generate": _generate, "tune": _tune}[args.command](args)
    except ValueError as e:  # a setting the engine refused (it names it): one line, not a traceback
        sub.choices[args.command].error(str(e))


if __name__ == "__main__":
    main()
