"""benchmarks/serve_paired.py's steady rate: a block's output rate between its first wave's end and its drain."""

import pytest

from benchmarks.serve_paired import steady_rate

WAVE_S, OUT = 8.0, 128


def test_waves_give_the_rate_of_whole_waves():
    # four clients in lockstep: each wave's four requests end together, 8 s a wave, three waves
    ends = [(WAVE_S * w + 0.001 * i, OUT) for w in (1, 2, 3) for i in range(4)]
    # the span runs from the first wave's last end to the second wave's last (when the last request is sent): one
    # wave's 512 tokens in 8 s
    assert steady_rate(ends, 4) == pytest.approx(4 * OUT / WAVE_S)


def test_a_staggered_drain_is_left_out():
    # the same work staggered: one request ends every 2 s in the steady part, then a drain of slowing ends
    steady = [(2.0 * k, OUT) for k in range(1, 9)]
    drain = [(16.0 + 3.0 * k, OUT) for k in range(1, 5)]
    rate = steady_rate(steady + drain, 4)
    # from the 4th end (8 s) to the 8th (16 s, when the last request is sent): the 5th to the 8th, one every 2 s
    assert rate == pytest.approx(4 * OUT / 8.0)
    whole = 12 * OUT / 28.0
    assert rate > whole            # the block's whole rate carries the drain; the steady one does not


def test_order_does_not_matter_and_short_blocks_have_none():
    ends = [(WAVE_S * w + 0.001 * i, OUT) for w in (1, 2, 3) for i in range(4)]
    assert steady_rate(list(reversed(ends)), 4) == steady_rate(ends, 4)
    assert steady_rate(ends[:11], 4) is None        # fewer than three requests per client
    assert steady_rate([(1.0, OUT)] * 12, 4) is None  # no span to divide by


def test_rescore_recomputes_the_steady_figure_only(tmp_path):
    import json

    from benchmarks.serve_paired import rescore

    waves = [WAVE_S * w + 0.001 * i for w in (1, 2, 3) for i in range(4)]
    stagger = [2.0 * k for k in range(1, 9)] + [16.0 + 3.0 * k for k in range(1, 5)]
    fig = lambda ends: {"requests": 12, "ok": 12, "tok_s": 50.0, "steady_tok_s": 1.0, "finish_s": ends}  # noqa: E731
    doc = {"concurrency": 4, "output_tokens": OUT, "servers": ["localinfer", "llama-server"],
           "blocks": [{"localinfer": fig(stagger), "llama-server": fig(waves)}],
           "pairs": [{"pair": 0, "failed": False, "ratio": {"tok_s": 1.0, "steady_tok_s": 0.5}}],
           "summary": {"peer": "llama-server", "tok_s": {"median": 1.0}}, "seed": 3}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    got = rescore(str(path))
    # staggered: one request every 2 s (64 tok/s); waves: 512 tokens every 8 s (64 tok/s)
    assert got["pairs"][0]["ratio"]["steady_tok_s"] == pytest.approx(1.0, rel=1e-3)
    assert got["blocks"][0]["localinfer"]["steady_tok_s"] == pytest.approx(64.0)
    assert got["summary"]["tok_s"] == {"median": 1.0}          # as recorded
    assert got["summary"]["steady_tok_s"]["pairs"] == 1


def test_rescore_needs_finish_times_and_a_seed(tmp_path):
    import json

    from benchmarks.serve_paired import rescore

    doc = {"concurrency": 4, "output_tokens": OUT, "servers": ["a", "b"], "pairs": [],
           "blocks": [{"a": {"requests": 12, "ok": 12}, "b": {"requests": 12, "ok": 12}}], "summary": {"peer": "b"}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="finish_s"):
        rescore(str(path))
    doc["blocks"][0]["a"]["finish_s"] = doc["blocks"][0]["b"]["finish_s"] = [1.0] * 12
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="seed"):
        rescore(str(path))
