"""benchmarks/gpu_serving.py --smoke: every section runs on the CPU with a tiny model and writes the JSON the GPU
run writes; a failing section leaves its error and the others their numbers; the time guard skips sections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_serving.py"
ROW_KEYS = {"batch", "step_s", "forward_s", "tok_s", "mbu", "forward_mbu", "roofline_s", "x_roofline"}
PREFIX_KEYS = {"prefill_s", "decode_step_ms", "blocks_peak", "blocks_without_sharing", "cached_tokens",
               "prefill_tokens_computed"}


def load(out: Path) -> dict:
    return json.loads((out / "gpu_serving.json").read_text())


@pytest.mark.slow    # ~10 s alone, ~30 s on a busy 2-core machine
def test_smoke_runs_every_section(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=150, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = load(tmp_path)
    from benchmarks.gpu_serving import SECTIONS

    assert set(SECTIONS) <= set(d) and d["smoke"] and d["failed_sections"] == []
    assert all("error" not in d[k] and "skipped" not in d[k] for k in SECTIONS if k != "transformers")
    assert d["setup"]["block_tokens"] == 16 and d["setup"]["decode_path"] == "padded (eager)"
    assert 64 in d["setup"]["graph_batches"]
    for key in ("decode", "decode_eager"):
        assert [row["batch"] for row in d[key]["rows"]] == [1, 4, 16, 64]
        assert all(ROW_KEYS <= set(row) for row in d[key]["rows"])
    assert [row["chapter_step_ms"] for row in d["throughput_vs_batch"]["rows"]] == [26.26, 26.62, 27.44, 29.63]
    shared, unshared = d["shared_prefix"], d["shared_prefix_no_sharing"]
    assert PREFIX_KEYS <= set(shared) and PREFIX_KEYS <= set(unshared)
    assert max(shared["cached_tokens"]) == shared["prefix_tokens"] and unshared["cached_tokens"] == [0]
    n, p, s = shared["requests"], shared["prompt_tokens"], shared["prefix_tokens"]
    assert shared["prefill_tokens_computed"] < unshared["prefill_tokens_computed"]
    assert shared["blocks_peak"] < unshared["blocks_peak"] == unshared["blocks_without_sharing"]
    assert shared["prefill_tokens_computed"] <= p + (n - 1) * (p - s) + n     # + decodes during prefill
    hf = d["transformers"]
    assert "skipped" in hf or ([row["batch"] for row in hf["rows"]] == [1, 16] and hf["rel_logit_diff"] < 0.05)
    assert {"batch1_decode_mbu", "batch64_x_roofline", "ours_over_transformers_b1",
            "ours_over_transformers_b16"} <= set(d["targets"])
    assert (tmp_path / "gpu_serving.txt").read_text().count("target ") >= 4


def test_a_failing_section_leaves_the_rest(tmp_path, monkeypatch):
    from benchmarks import gpu_serving

    def boom(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_serving, "decode", boom)
    monkeypatch.setattr(gpu_serving, "transformers_section", lambda *a, **k: {"skipped": "not in this test"})
    assert gpu_serving.main(["--smoke", "--out", str(tmp_path)]) == 1
    d = load(tmp_path)
    assert d["decode"]["error"] == "RuntimeError: boom" and "traceback" in d["decode"]
    assert "error" in d["throughput_vs_batch"]          # it needs decode's rows
    assert d["shared_prefix"]["prefill_s"] > 0 and "error" not in d["shared_prefix_no_sharing"]
    assert d["targets"]["batch1_decode_mbu"]["value"] is None
    assert set(d["failed_sections"]) >= {"decode", "throughput_vs_batch", "decode_eager"}


def test_time_guard_skips_sections(tmp_path):
    from benchmarks import gpu_serving

    assert gpu_serving.main(["--smoke", "--budget", "0", "--out", str(tmp_path)]) == 0
    d = load(tmp_path)
    assert all(d[k]["skipped"].startswith("time guard") for k in gpu_serving.SECTIONS)
