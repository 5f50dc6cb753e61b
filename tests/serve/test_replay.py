"""The scheduling example replayed from its trace file, through the API and the CLI.

At most 2 running; steps take 26.22 ms + 30.4 µs per new token + 3 ns per causal pair.
"""

import json
from pathlib import Path

import pytest

from localinfer.cli import main
from localinfer.serve.replay import load_trace, replay
from localinfer.serve.scheduler import SchedulerConfig
from localinfer.serve.step_model import LinearStepModel
from tests.support.chapter import close

TRACE = Path(__file__).parent / "data" / "chapter_trace.json"
STEP = "26.22,30.4,3"
CASES = {   # policy, flags -> (total ms, r0's longest gap ms) as printed
    "fixed": ((), 870, None),
    "continuous": ((), 766, 376),
    "chunked": (("--chunk", "2048", "--token-budget", "4096"), 844, 133),
}


def _api(policy):
    kw = {"chunk_tokens": 2048, "token_budget": 4096} if policy == "chunked" else {}
    return replay(load_trace(TRACE), SchedulerConfig(policy=policy, max_running=2, **kw),
                  LinearStepModel.parse(STEP)).as_json()


def _cli(capsys, *argv):
    rc = main(["replay", str(TRACE), "--max-running", "2", "--step-model", STEP, *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("policy", list(CASES))
def test_api_and_cli_agree_with_the_printed_figures(capsys, policy):
    flags, total, gap = CASES[policy]
    rc, out, _ = _cli(capsys, "--policy", policy, "--json", *flags)
    assert rc == 0
    got = json.loads(out)
    assert got == _api(policy)
    assert close(got["total_ms"], total)
    if gap is not None:
        assert close(got["requests"]["r0"]["max_gap_ms"], gap)
        assert max(r["max_gap_ms"] for r in got["requests"].values()) == got["requests"]["r0"]["max_gap_ms"]
    assert got["peak_running"] == 2
    for r in got["requests"].values():
        assert set(r) == {"first_token_ms", "finish_ms", "max_gap_ms", "preemptions", "queue_ms"}
        assert r["preemptions"] == 0


def test_chunking_cuts_the_gap_and_costs_makespan():
    cont, chunk = _api("continuous"), _api("chunked")
    assert chunk["requests"]["r0"]["max_gap_ms"] < cont["requests"]["r0"]["max_gap_ms"] / 2
    assert chunk["total_ms"] > cont["total_ms"]
    assert _api("fixed")["total_ms"] > chunk["total_ms"]


def test_text_table_totals_and_html(capsys, tmp_path):
    html = tmp_path / "t.html"
    rc, out, _ = _cli(capsys, "--policy", "continuous", "--html", str(html))
    assert rc == 0
    for word in ("makespan 765.6 ms", "throughput", "goodput 4/4", "TTFT p50", "ITL p50", "r3"):
        assert word in out
    page = html.read_text()
    assert page.startswith("<!doctype html>")
    assert page.count("<rect") == 8 * 2      # 8 steps, each computing for both running requests


def test_jsonl_trace_and_deadlines(capsys, tmp_path):
    items = json.loads(TRACE.read_text())
    items[3]["deadline_ms"] = 700
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(i) for i in items) + "\n")
    assert main(["replay", str(path), "--max-running", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["good_requests"] == 3 and got["finish_reasons"]["r3"] == "length"
    assert main(["replay", str(path), "--max-running", "2", "--json", "--deadline-aware"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["finish_reasons"]["r3"] == "deadline" and got["requests"]["r3"]["first_token_ms"] is None


def test_shared_prefix_through_replay(tmp_path, capsys):
    from tests.support import chapter

    spec_path = tmp_path / "qwen3-8b-default.gguf"
    chapter.spec(tmp_path)
    trace = tmp_path / "long.json"
    trace.write_text(json.dumps([{"id": f"q{i}", "arrival_ms": 0, "input": 8192, "output": 256, "prefix": "sys",
                                  "prefix_len": 6144} for i in range(40)]))
    base = ["replay", str(trace), "--model", str(spec_path), "--json", "--prefix-cached"]
    assert main(base + ["--max-running", "16"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["peak_kv_bytes"] == 6048 * 2**20           # 864 + 16 × 324 MiB
    assert main(base + ["--max-running", "64", "--kv-budget", "12GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_running"] == 35
    trace.write_text(json.dumps([{"id": f"q{i}", "arrival_ms": 0, "input": 8192, "output": 256} for i in range(40)]))
    assert main(base + ["--max-running", "64", "--kv-budget", "12GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_running"] == 10


@pytest.mark.parametrize("content, words", [
    ("{}", "non-empty JSON list"),
    ('[{"id": "a", "arrival_ms": 0, "input": 0, "output": 1}]', '"input" must be a whole number'),
    ('[{"id": "a", "arrival_ms": 0, "input": 5}]', '"output" is missing'),
    ('[{"id": "a", "arrival_ms": 0, "input": 5, "output": 1, "colour": 1}]', '"colour" is not a trace field'),
    ('[{"id": "a", "arrival_ms": 0, "input": 5, "output": 1, "prefix": "s", "prefix_len": 9}]', "exceeds input"),
    ('[{"id": "a", "arrival_ms": 0, "input": 5, "output": 1}, {"id": "a", "arrival_ms": 0, "input": 5, "output": 1}]',
     "unique"),
    ('[{"id": "a", "arrival_ms": 5, "input": 5, "output": 1, "deadline_ms": 1}]', '"deadline_ms" must be'),
    ("[1, 2", "line 1: not JSON"),
    ("[" * 100_000 + "]" * 100_000, "line 1: not JSON (nested too deeply)"),      # issue 32: was an internal error
    ('[{"id": "a", "arrival_ms": 0, "input": ' + "9" * 5000 + ', "output": 1}]', "line 1: not JSON"),
    ('[{"id": "a", "arrival_ms": 0, "input": 1e12, "output": 1}]', '"input" must be a whole number between'),
    ('[{"id": "a", "arrival_ms": 0, "input": 10000000000, "output": 1}]', '"input" must be a whole number between'),
    ('[{"id": "a", "arrival_ms": NaN, "input": 5, "output": 1}]', '"arrival_ms" must be a number'),
    ('[{"id": true, "arrival_ms": 0, "input": 5, "output": 1}]', '"id" must be a unique string'),
])
def test_bad_traces_are_one_line_errors(tmp_path, capsys, content, words):
    path = tmp_path / "t.json"
    path.write_text(content)
    rc = main(["replay", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err and err.startswith("error: ")


@pytest.mark.parametrize("argv, words", [
    (["--step-model", "1,2"], "three numbers"),
    (["--step-model", "1,-2,3"], "non-negative"),
    (["--device", "h200"], "--device needs --model"),
    (["--kv-budget", "1GiB"], "--kv-budget needs --model"),
    (["--max-running", "0"], "--max-running must be"),
    (["--block", "0"], "--block must be"),
    (["--policy", "chunked", "--itl-target", "50", "--device", "h200"], "--device needs --model"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, words):
    rc = main(["replay", str(TRACE), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err


def test_preemption_through_replay(tmp_path, capsys):
    from tests.support import chapter

    chapter.spec(tmp_path)
    trace = tmp_path / "p.json"
    trace.write_text(json.dumps([{"id": c, "arrival_ms": 0, "input": 2048, "output": 600} for c in "abc"]))
    base = ["replay", str(trace), "--model", str(tmp_path / "qwen3-8b-default.gguf"), "--max-running", "3", "--json"]
    assert main(base + ["--kv-budget", "1GiB", "--admission", "on_demand"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["preemptions"] >= 1 and small["recomputed_tokens"] > 0
    assert set(small["finish_reasons"].values()) == {"length"}
    assert small["peak_kv_bytes"] <= 2**30
    assert main(base + ["--kv-budget", "2GiB", "--admission", "on_demand"]) == 0
    assert json.loads(capsys.readouterr().out)["preemptions"] == 0


def test_html_to_a_folder_fails_before_the_work(tmp_path, capsys):
    rc = main(["replay", str(TRACE), "--html", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("error: ") and str(tmp_path) in err and "Traceback" not in err


def test_itl_target_bounds_every_gap(capsys):
    rc, out, _ = _cli(capsys, "--policy", "chunked", "--itl-target", "60", "--json")
    got = json.loads(out)
    assert rc == 0 and max(r["max_gap_ms"] for r in got["requests"].values()) <= 60.0
    assert got["total_ms"] > _api("chunked")["total_ms"]          # smaller chunks, more steps


def test_max_gap_bounds_every_running_streams_gap_and_spares_the_prompts_alone():
    """The gap bound cuts a prompt's chunk only while other requests decode: r0's and r1's prompts (none decoding
    yet) run whole, later prompts are cut so no stream waits more than 60 ms for its next token."""
    model = LinearStepModel.parse(STEP)
    plain = replay(load_trace(TRACE), SchedulerConfig(policy="chunked", max_running=2, chunk_tokens=2048,
                                                      token_budget=4096), model)
    bound = replay(load_trace(TRACE), SchedulerConfig(policy="chunked", max_running=2, chunk_tokens=2048,
                                                      token_budget=4096, max_gap_s=0.060), model)
    assert max(r.max_gap_s for r in plain.requests) > 0.060
    assert max(r.max_gap_s for r in bound.requests) <= 0.060 + 1e-9
    itl = replay(load_trace(TRACE), SchedulerConfig(policy="chunked", max_running=2, chunk_tokens=2048,
                                                    token_budget=4096, itl_target_s=0.060), model)
    first = {r.id: r.ttft_s for r in bound.requests}
    assert first["r0"] == min(r.ttft_s for r in plain.requests if r.id == "r0")    # alone: not cut
    assert first["r0"] < {r.id: r.ttft_s for r in itl.requests}["r0"]             # the ITL target cuts it anyway


def test_max_gap_needs_the_chunked_policy_and_a_positive_bound(capsys):
    rc, _, err = _cli(capsys, "--max-gap", "50")
    assert rc != 0 and "--max-gap" in err and "chunked" in err
    rc, _, err = _cli(capsys, "--policy", "chunked", "--max-gap", "-5")
    assert rc != 0 and "--max-gap" in err and "Traceback" not in err


def test_device_profile_step_model(tmp_path, capsys):
    from tests.support import chapter

    chapter.spec(tmp_path)
    rc = main(["replay", str(TRACE), "--max-running", "2", "--device", "rtx-pro-6000", "--model",
               str(tmp_path / "qwen3-8b-default.gguf"), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and 0 < got["total_ms"] < 10_000 and got["peak_kv_bytes"] > 0


def test_chunk_flags_need_the_chunked_policy(capsys):
    rc, _, err = _cli(capsys, "--chunk", "512")
    assert rc == 2 and "--policy chunked" in err


def test_drop_late_stops_a_request_past_its_deadline(tmp_path, capsys):
    items = json.loads(TRACE.read_text())
    items[0]["deadline_ms"] = 300
    path = tmp_path / "t.json"
    path.write_text(json.dumps(items))
    assert main(["replay", str(path), "--max-running", "2", "--json", "--drop-late"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["finish_reasons"]["r0"] == "deadline" and 300 < got["requests"]["r0"]["finish_ms"] < 700
    assert got["total_ms"] < _api("continuous")["total_ms"]


def test_the_largest_gap_is_named_with_the_steps_that_made_it(capsys):
    """The chapter's 376 ms gap of r0 (continuous batching): the step that prefilled r2's 8192 tokens beside r0's
    decode; the gaps read from the step records are the requests' own."""
    result = replay(load_trace(TRACE), SchedulerConfig(policy="continuous", max_running=2),
                    LinearStepModel.parse(STEP))
    top = result.largest_gaps(2)
    assert top[0].request == "r0" and close(top[0].ms, 376)
    assert [(s["prefill"], s["decodes"], s["admitted"]) for s in top[0].steps] == [(8192, 1, ["r2"])]
    assert close(top[0].ms, max(r.max_gap_s for r in result.requests) * 1e3) and top[0].ms >= top[1].ms
    rc, out, _ = _cli(capsys, "--policy", "continuous")
    assert rc == 0 and "r0: 376 ms = 376 ms (8192 prompt tokens, 1 decodes, 1 seated)" in out
