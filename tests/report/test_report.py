"""`localinfer report`: the capacity matrix, its four renderings, escaping, atomic -o, measured vs predicted."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.memory import FitRequest
from localinfer.cli import main
from localinfer.devices.profiles import get_device
from localinfer.errors import UsageError
from localinfer.model.cost import model_cost
from localinfer.model.spec import ModelSpec
from localinfer.plan.bench_import import load_bench
from localinfer.plan.fit import fit_device
from localinfer.plan.speed import predict_speed
from localinfer.report.capacity import build_report, render_json, render_md, render_text
from localinfer.report.html import render_html
from tests.support import browser, chapter

HOSTILE = "evil<script>alert(1)</script>|\x1b[31mred\x07"
DEVICES = ("rtx-pro-6000", "m2-max-96gb", "rtx-4090")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    return [chapter.spec(tmp), chapter.spec(tmp, "qwen3-235b-a22b", "q2_k")]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "evil.gguf"
    write_skeleton({"arch": "llama", "name": HOSTILE, "n_layers": 2, "n_embd": 64, "n_head": 4, "n_ff": 128,
                    "vocab_size": 256, "context_length": 4096, "type": "f16"}, path)
    return path


@pytest.fixture(scope="module")
def report(models):
    devs = [get_device(n) for n in DEVICES]
    return build_report(models, devs, (2048, 8192), ("f16", "q8_0"), plots=True)


def test_capacity_matches_the_fit_breakdown(report, models):
    qwen, moe = models
    dev = get_device("rtx-pro-6000")
    r = next(x for x in report.rows if x.model == qwen.name and x.device == dev.name)
    bd = fit_device(qwen, dev, FitRequest(n_ctx=8192), search=False).breakdown
    kv = bd.sum("kv", "device")
    assert kv == 1152 * 1024 * 1024                                          # 8192 cells × 144 KiB
    fixed = bd.device_bytes - kv                                             # weights, compute, output
    assert r.weights_fit and r.cell(8192, "f16").max_requests == (dev.usable_bytes - fixed) // kv
    full = fit_device(qwen, dev, FitRequest(n_ctx=8192, n_seq=r.cell(8192, "f16").max_requests), search=False)
    assert full.fits                                                         # the count really fits
    assert r.cell(8192, "q8_0").max_requests > r.cell(8192, "f16").max_requests
    assert r.largest_ctx["f16"] == qwen.n_ctx_train                   # memory allows more than the model
    assert r.cheapest_kv[2048] == "f16"
    # speeds as fit predicts them (llama.cpp's kernel model), not the chapter's vLLM roofline that `plan` keeps
    fit_speed = predict_speed(qwen, dev, FitRequest(n_ctx=2048))
    assert r.cell(2048, "f16").decode_tok_s == pytest.approx(fit_speed["decode_tok_s"], rel=1e-9)
    assert r.cell(2048, "f16").prefill_tok_s == pytest.approx(fit_speed["prefill_tok_s"], rel=1e-9)
    assert r.speed_band["decode_error"] == fit_speed["decode_error"]
    cost = model_cost(qwen)
    assert r.cell(2048, "f16").decode_tok_s > 2 / (cost.step_bytes(1, 2048) / (1792e9 * 0.33))   # roofline: 38.3
    m2 = next(x for x in report.rows if x.model == moe.name and x.device == "m2-max-96gb")
    assert m2.weights_fit and m2.cheapest_kv[8192] == "q8_0" and m2.largest_ctx["f16"] < 8192
    assert m2.cell(8192, "f16").max_requests == 0 and m2.cell(8192, "q8_0").max_requests >= 1


def test_weights_that_do_not_fit_get_an_offload_plan_only_with_a_link(report, models):
    moe = models[1]
    small = next(x for x in report.rows if x.model == moe.name and x.device == "rtx-4090")
    assert not small.weights_fit and small.cheapest_kv[2048] is None
    assert small.cell(2048, "f16").decode_tok_s is None
    assert small.offload is not None and small.offload.kinds == "experts"
    assert small.offload.net_bytes >= moe.weight_bytes - get_device("rtx-4090").usable_bytes
    assert small.offload.decode_tok_s < 10                                # bound by the PCIe copy
    assert all(r.offload is None for r in report.rows if r.weights_fit)


def test_renderings_agree(report, models):
    text, md, js, html = render_text(report), render_md(report), render_json(report), render_html(report)
    for out in (text, md, html):
        assert models[0].name in out and "rtx-pro-6000" in out and "experts groups" in out
    data = json.loads(js)
    assert data["schema"] == "localinfer.report" and data["version"] == 1
    assert len(data["rows"]) == 2 * len(DEVICES) and data["rows"][0]["cells"][0]["max_requests"] >= 1
    assert md.count("\n|") >= 2 * 3 * 2                                  # a row per device × context
    assert "<script" not in html and html.count("<svg") >= 3 and "http://" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


def test_untrusted_names_are_escaped(hostile):
    spec = ModelSpec.from_gguf(hostile)
    rep = build_report([spec], [get_device("rtx-4090")], (1024,), ("f16",), plots=True)
    text, md, html, js = render_text(rep), render_md(rep), render_html(rep), render_json(rep)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text
    assert "<script>" not in md and "\\|" in md and "\x1b" not in md
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert json.loads(js)["models"] == [HOSTILE]                          # JSON keeps the value, escaped
    assert "\x1b" not in js


def _bench_doc(path, cost):
    """A localinfer.generation.bench v1 document whose decode steps follow 3 ms + bytes / 20 GB/s exactly."""
    def step(depth, n):
        return 3e-3 + cost.step_bytes(1, depth + n // 2) / 20e9
    decode = [{"depth": d, "tokens": 33, "seconds": 32 * step(d, 33), "tok_s": 1 / step(d, 33)}
              for d in (0, 512, 1024, 2048)]
    prefill = [{"tokens": n, "seconds": cost.prefill_flops(n) / 50e9, "tok_s": 0} for n in (128, 512, 2048)]
    doc = {"schema": "localinfer.generation.bench", "version": 1, "model": {"name": "m"},
           "runs": [{"type_k": "f16", "type_v": "f16", "prefill": prefill, "decode": decode}]}
    path.write_text(json.dumps(doc))
    return path


def test_measured_beside_predicted(tmp_path, models):
    qwen = models[0]
    cal = load_bench(_bench_doc(tmp_path / "b.json", model_cost(qwen)))
    assert len(cal.decode) == 4 and len(cal.prefill) == 3
    rep = build_report([qwen], [get_device("rtx-4090")], (2048,), ("f16",), calibrations={"rtx-4090": cal})
    rows = rep.rows[0].measured
    inner = [m for m in rows if m.kind == "decode" and m.ctx in (512 + 16, 1024 + 16)]
    assert len(inner) == 2 and all(abs(m.error) < 1e-9 for m in inner)   # interpolation of a straight line
    pre = [m for m in rows if m.kind == "prefill"]
    assert len(pre) == 3 and all(abs(m.error) < 0.05 for m in pre)
    assert "measured vs predicted" in render_text(rep)


def test_bench_files_rejected_cleanly(tmp_path):
    deep, huge = "[" * 100_000 + "]" * 100_000, '[{"n_prompt": ' + "9" * 5000 + "}]"     # issue 32: internal errors
    for content in ("not json", "[1, 2]", json.dumps({"schema": "other"}), json.dumps([{"n_prompt": -5}]), deep, huge):
        p = tmp_path / "bad.json"
        p.write_text(content)
        with pytest.raises(UsageError) as e:
            load_bench(p)
        assert e.value.flag == "--bench"
    p.write_text(json.dumps([{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 1000.0, "type_k": "q8_0"},
                             {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 40.0, "type_k": "q8_0"}]))
    cal = load_bench(p)
    assert cal.prefill[0].seconds == pytest.approx(0.512) and cal.decode[0].kv == ("q8_0", "q8_0")


# ---- the command ------------------------------------------------------------------------------------

def test_output_file_is_written_atomically(models, tmp_path, capsys):
    out = tmp_path / "r.md"
    out.write_text("previous")
    rc = main(["report", models[0].path, "--devices", "rtx-pro-6000", "--format", "md", "-o", str(out)])
    assert rc == 0 and out.read_text().startswith("# localinfer capacity report")
    assert capsys.readouterr().out == "" and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    bad = tmp_path / "missing-dir" / "r.md"
    rc = main(["report", models[0].path, "--devices", "rtx-pro-6000", "-o", str(bad)])
    assert rc != 0 and not bad.exists() and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--ctx", "8k"], "--ctx"), (["--ctx", "0"], "--ctx"),
                                        (["--kv", "q9"], "--kv"), (["--bench", "rtx-4090=/nonexistent.json"], "--bench"),
                                        (["--bench", "/nonexistent.json"], "--bench")])
def test_bad_arguments(models, capsys, argv, flag):
    rc = main(["report", models[0].path, "--devices", "rtx-4090", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "Traceback" not in err


def test_html_renders_in_headless_chromium(report, tmp_path):
    browser.require(playwright=False)   # skipped without chromium; under CI (LOCALINFER_REQUIRE_BROWSER=1) a failure
    page, png = tmp_path / "r.html", tmp_path / "r.png"
    page.write_text(render_html(report))
    subprocess.run([browser.chromium_path(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2400", f"--screenshot={png}",
                    page.as_uri()], capture_output=True, timeout=120, check=False)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000          # tables and plots, not a blank page
