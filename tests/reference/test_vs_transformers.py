"""scripts/bench/bench_vs_transformers.py --quick against transformers on a random checkpoint transformers makes.
Needs the reference extra (torch, transformers): `make test-reference` builds its own venv for it; the plain suite
skips it."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the reference extra (torch, transformers): make test-reference")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import bench_vs_transformers  # noqa: E402


def test_quick_run_times_both_sides_and_they_agree(tmp_path):
    returned = bench_vs_transformers.main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_vs_transformers.json").read_text())
    assert result == json.loads(json.dumps(returned))
    assert result["model"] == "tiny-random" and result["dtype"] == "float32"
    fwd, e2e = result["forward"], result["end_to_end"]
    for part in (fwd, e2e):
        assert part["gdn_jax_s"] > 0 and part["transformers_s"] > 0
        assert part["speedup"] == pytest.approx(part["transformers_s"] / part["gdn_jax_s"])
    # the same function: float32 logprobs agree closely, so the greedy tokens are the same
    assert fwd["tokens"] == 256 and fwd["same_next_token"]
    assert fwd["max_abs_logprob_diff"] < 1e-4
    assert e2e["greedy_token_agreement"] == 1.0 and e2e["identical_requests"] == e2e["requests"] == 4
    # the engine side reuses the shared 96-token system prompt up to its checkpoint at 64 in the 3 later requests
    assert e2e["cached_tokens"] == (e2e["requests"] - 1) * 64
