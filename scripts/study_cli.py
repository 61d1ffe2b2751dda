"""What the study scripts share: the command line every study takes (`--model`, `--dtype`, `--out`, `--quick`), the
JSON it writes, and figures drawn without a display.

The scripts import this module by name: `python scripts/<study>.py` puts scripts/ on sys.path; a test or a notebook
that imports a study puts it there itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from gdn_jax.entrypoints.cli import HelpFormatter, nonnegative_int, positive_int, writable_file  # noqa: F401 - the flag types
from gdn_jax.worker.memory import GPU_MEMORY_UTILIZATION

DEFAULT_MODEL = "tiny"  # the trained built-in model
DTYPES = ("float32", "bfloat16")


def dtype_names(text: str) -> list[str]:
    """An argparse type: comma-separated dtypes the engine runs (`DTYPES`), e.g. "float32,bfloat16"; checked when
    parsed, so that a benchmark refuses a wrong one before it has run the others."""
    names = text.split(",")
    wrong = [n for n in names if n not in DTYPES]
    if wrong:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, wrong))}: expected {' or '.join(DTYPES)}")
    return names


def study_parser(prog: str, doc: str, outputs: str, quick: str, *, model_default: str | None = DEFAULT_MODEL,
                 model_help: str = "preset name or HF folder", dtypes: tuple[str, ...] = DTYPES,
                 model_aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The parser with the four flags of every study; the script adds its own. `doc` (the module docstring) is the
    description; `outputs` names the files written under --out; `quick` says what --quick shrinks."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
    ap.add_argument("--model", *model_aliases, default=model_default, help=model_help)
    ap.add_argument("--dtype", default="float32", choices=list(dtypes), help="weights and activations")
    ap.add_argument("--out", default="results", help=f"folder for {outputs}")
    ap.add_argument("--quick", action="store_true", help=f"{quick} (a test runs this)")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None, files: tuple[str, ...] = ()) -> argparse.Namespace:
    """`ap.parse_args(argv)`, then --out made ready before anything runs: a folder that cannot be written, or one of
    the `files` the study writes there that cannot be (a folder of that name), ends the run now (an argparse error
    naming it), not after the study has run. Tried by writing (`gdn_jax.entrypoints.cli.writable_file`): permission bits alone
    pass root on a read-only file system."""
    args = ap.parse_args(argv)
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out}: {e.strerror or e}")
    for name in files or (".write-probe",):
        problem = writable_file(Path(args.out) / name)
        if problem:
            ap.error(f"--out {args.out}: {Path(args.out) / name} {problem}")
    return args


def model_config(model: str):
    """`model`'s `ModelConfig` read from its config alone (no weights), so that a study can check its settings against
    the model before it builds an engine; None for a name the engine will refuse with its own error."""
    from gdn_jax.config import PRESETS, ModelConfig
    from gdn_jax.model.weights import model_folder

    if model in PRESETS:
        return PRESETS[model]
    folder = model_folder(model)
    return ModelConfig.from_pretrained(folder) if folder is not None and (folder / "config.json").is_file() else None


def check_length(ap: argparse.ArgumentParser, model: str, needed: int, flags: str) -> None:
    """An argparse error naming `flags` when the sequences they ask for (`needed` tokens, the engines' max_model_len)
    pass the model's positions: the engine's own error names only max_model_len, which no study takes."""
    cfg = model_config(model)
    if cfg is not None and needed > cfg.max_position_embeddings:
        ap.error(f"{flags}: sequences of up to {needed} tokens, beyond the {cfg.max_position_embeddings} positions of "
                 f"model {model}")


def fit_model_len(model: str, default: int) -> int:
    """A study's max_model_len: `default`, or the model's positions where it has fewer (said on stdout), since the
    engine refuses a max_model_len beyond them. The study checks first (`check_length`) that its sequences fit."""
    cfg = model_config(model)
    if cfg is None or cfg.max_position_embeddings >= default:
        return default
    print(f"max_model_len {cfg.max_position_embeddings}: the positions of model {model}, fewer than the study's "
          f"{default}")
    return cfg.max_position_embeddings


def environment() -> dict:
    """What a run needs beside its settings to be reproduced: the package, its git commit (when run from a
    checkout), JAX and the backend it ran on, Python, the machine."""
    import jax
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    try:
        version = metadata.version("gdn-jax")
    except metadata.PackageNotFoundError:
        version = None
    return {"gdn_jax": version, "git_commit": commit, "git_dirty": dirty, "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib"), "backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.devices()], "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count()}


def run(main) -> None:
    """A study's command-line entry: a bad setting that the engine or the workload finds (a ValueError naming it)
    ends the run with `error: ...` and exit status 2, not a traceback."""
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def write_json(out: str | Path, name: str, result: dict) -> Path:
    """Writes `result` to OUT/name (creating OUT) and returns the path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def share_of(engines: int) -> dict:
    """`LLMEngine` arguments that give one of `engines` engines built side by side in this process its part of the
    default accelerator memory (`gpu_memory_utilization` is per engine; the CPU's budget is fixed, so this changes
    nothing there). An engine built with `pools_of` another's needs none: its pools are as large."""
    return {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION / engines}


def pools_of(engine) -> dict:
    """`LLMEngine` arguments for pools of the same sizes as `engine`'s. Engines of one model whose pools have the same
    shapes run the same compiled steps: a study that compares engines (cache on / off, reuse modes) then compiles
    each step shape once, not once per engine. With the prefix cache off the extra linear slots just stay free."""
    return {"num_kv_blocks": engine.memory.num_kv_blocks, "num_linear_slots": engine.memory.num_linear_slots}


def figure(figsize: tuple[float, float], ax=None):
    """The figure and axes a study plot draws on: `ax`'s if given (a notebook passes `plt.subplots()`'s, which it
    shows inline), else a new figure made without pyplot, so that a headless script neither needs nor changes a
    backend."""
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def save(fig, path: str | Path | None) -> None:
    """Saves a `figure()` as PNG (dpi 120) when a path is given; figures made here need no closing."""
    if path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
