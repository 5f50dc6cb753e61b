"""``serve --step-log``: every engine step a JSON line, from which each stream's token times and its largest
gaps are read back (the real server on the embedded model, 1 thread)."""

from __future__ import annotations

import threading

import pytest

from localinfer.serve.gaps import largest_gaps, token_times
from localinfer.serve.step_log import read_step_log
from tests.serve.test_http_support import LiveServer


def test_a_served_load_leaves_a_step_log_that_names_each_gap(default_model, tmp_path):
    openai = pytest.importorskip("openai")
    log = tmp_path / "steps.jsonl"
    srv = LiveServer(default_model, parallel=2, max_queue=4, ctx=512, step_log=str(log))
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
        outs = {}

        def ask(i):
            r = client.completions.create(model="smollm2", prompt=f"Count: {i}, {i + 1},", max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
            outs[i] = r.usage.completion_tokens

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        srv.wait_idle()
    finally:
        srv.stop()
    records = read_step_log(str(log))
    assert outs == {0: 12, 1: 12, 2: 12}
    times = token_times(records)
    assert sorted(len(t) for t in times.values() if len(t) > 1) == [12, 12, 12]   # (the calibration step aside)
    kinds = {c[3] for r in records for c in r["chunks"]}
    assert {"prefill", "decode"} <= kinds and all(r["predicted_s"] is not None for r in records)
    top = largest_gaps(records, 3)
    assert top and all(g.ms > 0 and g.steps for g in top)
    assert top[0].ms == pytest.approx(max(b - a for t in times.values() for a, b in zip(t, t[1:])) * 1e3)


def test_the_step_log_never_writes_over_the_model(default_model, capsys):
    from localinfer.cli import main

    rc = main(["serve", str(default_model), "--port", "0", "--step-log", str(default_model)])
    err = capsys.readouterr().err
    assert rc != 0 and "input" in err and "Traceback" not in err
