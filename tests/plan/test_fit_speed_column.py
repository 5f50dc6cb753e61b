"""`localinfer fit` also says how fast the model will run, from the profile alone."""

from __future__ import annotations

import json

from gguf_tools.skeleton import write_skeleton
from localinfer.cli import main


def _fit_json(capsys, *argv) -> dict:
    assert main(["fit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_8b_decode_on_rtx_pro_6000_matches_the_chapters_measurement(tmp_path, capsys):
    # SPEC §8.2/8.6: Qwen3-8B BF16, 2K context, batch 1 measured 26.26 ms per step (≈ 37-38 tok/s);
    # the profile carries the 33% decode MBU measured there, so the prediction must land on it.
    path = write_skeleton("qwen3-8b", tmp_path / "q8b.gguf")
    doc = _fit_json(capsys, str(path), "--ctx", "2048", "--device", "rtx-pro-6000")
    speed = doc["devices"][0]["speed"]
    assert speed["decode_bound"] == "memory"
    assert abs(speed["decode_step_s"] - 26.26e-3) / 26.26e-3 < 0.02
    assert speed["prefill_tok_s"] > 1000 * speed["decode_tok_s"] / 100  # prefill is compute-bound, far faster


def test_no_speed_where_the_profile_has_no_bandwidth(capsys):
    doc = _fit_json(capsys, "--device", "local")
    assert doc["devices"][0]["speed"] is None


def test_text_report_prints_the_predicted_speed(tmp_path, capsys):
    path = write_skeleton("qwen3-8b", tmp_path / "q8b.gguf", type="q4_0")
    assert main(["fit", str(path), "--device", "h200", "--ctx", "8192"]) == 0
    out = capsys.readouterr().out
    assert "speed (predicted, 1 request, 8K context)" in out and "decode" in out
