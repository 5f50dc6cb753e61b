"""`localinfer bench serve --url URL | MODEL` and benchmarks/serve_load.py: one line and a non-zero exit for bad
input, the JSON others read, `bench MODEL` unchanged (a model file named `serve` included)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from localinfer.cli import build_parser, main
from localinfer.commands.bench import serve_requested

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--requests", "2", "--prompt-tokens", "12", "--output-tokens", "4"]
RUN_KEYS = {"mode", "output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "goodput_req_s", "good", "ok",
            "requests", "peaks"}                     # and concurrency (closed loop) or rate_req_s (open loop)


def _main(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:                         # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, code, words", [
    (["--url", "ftp://127.0.0.1/v1"], 2, "--url"), (["--url", "localhost:8080"], 2, "--url"),
    (["--url", "http://127.0.0.1:8080/v1", "--concurrency", "0"], 2, "--concurrency"),
    (["--url", "http://127.0.0.1:8080/v1", "--concurrency", "1,x"], 2, "--concurrency"),
    (["--url", "http://127.0.0.1:8080/v1", "--rate=-1"], 2, "--rate"),
    (["--url", "http://127.0.0.1:8080/v1", "--concurrency", "", "--rate", ""], 2, "nothing to run"),
    (["--url", "http://127.0.0.1:8080/v1", "--requests", "0"], 2, "--requests"),
    (["--url", "http://127.0.0.1:8080/v1", "--extra-body", "[1]"], 2, "--extra-body"),
    (["model.gguf", "--url", "http://127.0.0.1:8080/v1"], 2, "not both"),
    (["/nonexistent/model.gguf"], 1, "model.gguf"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(argv, code, words, capsys):
    got, out, err = _main(["bench", "serve", *argv], capsys)
    assert got == code, err
    assert words in err and "Traceback" not in err and out == ""
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_an_unreachable_server_exits_1_with_one_line(capsys, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    code, _, err = _main(["bench", "serve", "--url", url, "--concurrency", "1", *TINY,
                          "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1 and "cannot reach" in err and url in err and "Traceback" not in err
    assert err.splitlines()[0].startswith("error:") and len(err.splitlines()) <= 2
    assert not (tmp_path / "r.json").exists()


def test_an_unwritable_json_path_is_refused_before_the_run(capsys, tmp_path):
    code, _, err = _main(["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}/v1",
                          "--json", str(tmp_path / "missing" / "r.json")], capsys)
    assert code == 1 and "does not exist" in err and "cannot reach" not in err


def test_which_form_bench_takes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert serve_requested(["serve"]) and serve_requested(["--debug", "serve", "--url", "http://h/v1"])
    assert not serve_requested([]) and not serve_requested(["model.gguf"]) and not serve_requested(["--kv", "f16"])
    (tmp_path / "serve").mkdir()
    assert serve_requested(["serve"])                 # a folder named serve is no model
    (tmp_path / "serve").rmdir()
    (tmp_path / "serve").write_bytes(b"GGUF")
    assert not serve_requested(["serve"])             # a file named serve is benchmarked as the model it may be
    assert serve_requested(["serve", "--url", "http://h/v1"]) and serve_requested(["serve", "--url=http://h/v1"])
    args = build_parser("bench", ["bench", "serve", "--kv", "f16"]).parse_args(["bench", "serve", "--kv", "f16"])
    assert args.model == "serve" and not hasattr(args, "bench_form")
    args = build_parser("bench", ["bench", "m.gguf", "--gen", "8"]).parse_args(["bench", "m.gguf", "--gen", "8"])
    assert args.model == "m.gguf" and args.gen == 8


def test_a_file_named_serve_is_still_a_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "serve").write_bytes(b"not a gguf file")
    code, _, err = _main(["bench", "serve"], capsys)
    assert code == 3 and "serve" in err and "Traceback" not in err      # the GGUF reader refused it


def test_bench_serve_help_names_the_load_flags(capsys):
    code, out, _ = _main(["bench", "serve", "--help"], capsys)
    assert code == 0
    for flag in ("--url", "--concurrency", "--rate", "--shared-prefix", "--slo-ttft", "--deadline-ms", "--json"):
        assert flag in out
    code, out, _ = _main(["bench", "--help"], capsys)
    assert code == 0 and "--kv" in out and "bench serve --help" in out and "--concurrency" not in out


@pytest.fixture(scope="module")
def srv(default_model, request):
    pytest.importorskip("httpx")
    from tests.serve.test_http_support import shared

    return shared(default_model, request.config)


def test_bench_serve_against_a_url_prints_a_table_and_writes_json(srv, capsys, tmp_path):
    out_file = tmp_path / "r.json"
    code, out, err = _main(["bench", "serve", "--url", srv.base_url, "--concurrency", "1", "--rate", "30", *TINY,
                            "--label", "li", "--json", str(out_file)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("li") and lines[1].split()[:2] == ["run", "tok/s"]
    assert lines[2].split()[0] == "c=1" and lines[3].split()[0] == "rate=30" and len(lines) == 4
    assert "results written to" in err and "concurrency 1" in err          # the progress bar
    doc = json.loads(out_file.read_text())
    assert doc["server"] == "li" and doc["settings"]["requests"] == 2 and "api_key" not in doc["settings"]
    assert [r["ok"] for r in doc["runs"]] == [2, 2] and RUN_KEYS | {"concurrency"} <= set(doc["runs"][0])
    assert [r["output_tokens"] for r in doc["runs"]] == [8, 8]


def test_serve_load_script_keeps_its_flags_and_json(srv, tmp_path):
    out_file = tmp_path / "load.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", srv.base_url, "--label", "li",
           "--concurrency", "", "--rate", "20", "--shared-prefix", "8", *TINY, "--slo-ttft", "30", "--slo-e2e", "30",
           "--deadline-ms", "60000", "--out", str(out_file)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out_file.read_text())
    assert doc["server"] == "li" and len(doc["runs"]) == 1
    run = doc["runs"][0]
    assert RUN_KEYS | {"rate_req_s"} <= set(run) and run["mode"] == "open" and run["rate_req_s"] == 20.0
    assert run["ok"] == run["requests"] == 2 and run["good"] <= run["ok"]
    assert doc["settings"]["shared_prefix"] == 8 and doc["settings"]["deadline_ms"] == 60000
    assert "c=" not in r.stdout and "rate=20" in r.stderr                  # the summary goes to stderr
    r = subprocess.run([*cmd[:2], "--url", "ftp://nowhere"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--url" in r.stderr and "Traceback" not in r.stderr


def test_bench_serve_model_starts_and_stops_localinfer_serve(capsys):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    code, out, err = _main(["bench", "serve", "--threads", "1", "--ctx", "256", "--parallel", "2",
                            "--concurrency", "2", *TINY, "--json", "-"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["server"].startswith("http://127.0.0.1:") and doc["settings"]["parallel"] == 2
    assert doc["runs"][0]["ok"] == 2 and doc["runs"][0]["peaks"]["localinfer_requests_running"] <= 2
    with pytest.raises(httpx.TransportError):         # the server it started is gone
        httpx.get(doc["server"].removesuffix("/v1") + "/health", timeout=2)


def test_bench_serve_model_that_does_not_start_is_one_line(capsys):
    code, _, err = _main(["bench", "serve", "--parallel", "0", "--concurrency", "1", *TINY], capsys)
    assert code == 1 and "localinfer serve did not start" in err and "--parallel" in err
    assert "Traceback" not in err
