"""Recurrent-state snapshots in the prefix cache, on the simulated executor (SPEC.md §8.3: a hybrid model reuses a
prefix only from a snapshot) and in the store and policy themselves."""

from __future__ import annotations

import json

import pytest

from localinfer.backends.executor import SeqState
from localinfer.serve.replay import parse_trace, replay
from localinfer.serve.scheduler import SchedulerConfig
from localinfer.serve.snapshots import SnapshotPolicy, Snapshots
from localinfer.serve.step_model import LinearStepModel

STEP = LinearStepModel(26.22e-3, 30.4e-6, 3e-9)      # the chapter's step model (§8.2)
QWEN3_NEXT_STATE = 79_036_416                          # 75.4 MiB: Qwen3-Next-80B's recurrent state per sequence


def _two_requests(match: int, tail_a: int = 512, tail_b: int = 256):
    """Request b arrives after a has finished and shares a's first ``match`` tokens."""
    return parse_trace([
        {"id": "a", "arrival_ms": 0, "input": match + tail_a, "output": 4, "prefix": "doc", "prefix_len": match},
        {"id": "b", "arrival_ms": 600_000, "input": match + tail_b, "output": 4, "prefix": "doc", "prefix_len": match},
    ])


def _b(result):
    return next(r for r in result.requests if r.id == "b")


def test_the_chapters_hybrid_hit_restores_8192_and_recomputes_2560():
    """§8.3: a match at 10,752 tokens with snapshots at 4096 and 8192 restores 8192 and recomputes 2560."""
    result = replay(_two_requests(10_752), SchedulerConfig(max_running=2), STEP, state_bytes=QWEN3_NEXT_STATE,
                    snapshot_policy=SnapshotPolicy(stride=4096))
    b = _b(result)
    assert (b.cached, b.past_snapshot) == (8192, 2560)
    summary = result.snapshot_summary()
    assert summary["restored"] == 1 and summary["recomputed_tokens"] == 2560
    assert summary["requests"]["b"] == {"cached": 8192, "matched": 10_752, "recomputed_past_snapshot": 2560}
    # each save and each restore moves the 75.4 MiB state at 32 GB/s: 2.47 ms on the clock
    moves = summary["taken"] + summary["restored"]
    assert summary["state_ms"] == pytest.approx(moves * QWEN3_NEXT_STATE / 32e9 * 1e3)
    attention = replay(_two_requests(10_752), SchedulerConfig(max_running=2), STEP)     # an attention-only model
    assert _b(attention).cached == 10_752 and attention.snapshot_summary() is None
    assert _b(result).first_token_s - _b(result).arrival_s > _b(attention).first_token_s - _b(attention).arrival_s


@pytest.mark.parametrize(("stride", "match"), [(1024, 4992), (2048, 6144), (512, 10_000), (4096, 3000)])
def test_a_hit_restores_the_deepest_snapshot_at_or_below_the_match(stride, match):
    result = replay(_two_requests(match), SchedulerConfig(max_running=2), STEP, state_bytes=1 << 20,
                    snapshot_policy=SnapshotPolicy(stride=stride, prompt_end=False, reply_end=False))
    matched = match // 16 * 16                           # whole blocks
    restored = matched // stride * stride
    b = _b(result)
    assert (b.cached, b.past_snapshot) == (restored, matched - restored)


def test_replay_cli_prints_the_snapshot_figures(tmp_path, capsys):
    from localinfer.cli import main

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([{"id": "a", "arrival_ms": 0, "input": 11_264, "output": 4, "prefix": "doc",
                                  "prefix_len": 10_752},
                                 {"id": "b", "arrival_ms": 60_000, "input": 11_008, "output": 4, "prefix": "doc",
                                  "prefix_len": 10_752}]))
    assert main(["replay", str(trace), "--state-size", "75.4MiB", "--snapshot-stride", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["snapshots"]["requests"]["b"]["cached"] == 8192
    assert main(["replay", str(trace), "--snapshot-stride", "4096"]) != 0      # no recurrent state to snapshot
    assert "--snapshot-stride" in capsys.readouterr().err


def test_policy_boundaries_are_whole_blocks_at_the_stride_and_the_prompt_end():
    policy = SnapshotPolicy(stride=100)      # rounded down to whole blocks of 16: 96
    assert policy.boundaries(300, 16) == [96, 192, 288]
    assert SnapshotPolicy(stride=0).boundaries(300, 16) == [288]
    assert SnapshotPolicy(stride=0).boundaries(288, 16) == [272, 288]      # a resend's hit, and the end itself
    assert policy.next_boundary(96, 300, 16) == 192 and policy.next_boundary(288, 300, 16) is None
    with pytest.raises(Exception, match="snapshot stride"):
        SnapshotPolicy(stride=-1)


def test_the_store_keeps_its_budget_least_recently_used_first():
    snaps = Snapshots(SnapshotPolicy(), budget=250)
    for key in range(3):
        assert snaps.put(key, SeqState(16 * (key + 1), 100))
    assert len(snaps) == 2 and 0 not in snaps and snaps.bytes == 200 and snaps.evicted == 1
    snaps.get(1)                                  # 1 is now the most recently used: 2 goes next
    snaps.put(3, SeqState(64, 100))
    assert 1 in snaps and 2 not in snaps
    assert not snaps.put(4, SeqState(64, 251))     # larger than the whole budget
    assert snaps.depth([7, 1, 8, 3], 4) == 4 and snaps.depth([7, 1, 8, 3], 3) == 2 and snaps.depth([7], 1) == 0
    snaps.discard(3)
    assert snaps.bytes == 100 and snaps.depth([7, 1, 8, 3], 4) == 2


def test_a_warm_cache_holds_the_prefixes_states_too():
    """``--prefix-cached`` on a hybrid model: the named prefix's state at its end is there, as its blocks are."""
    trace = parse_trace([{"id": "b", "arrival_ms": 0, "input": 11_008, "output": 4, "prefix": "doc",
                          "prefix_len": 10_752}])
    result = replay(trace, SchedulerConfig(max_running=2), STEP, state_bytes=1 << 20, prefix_cached=True,
                    snapshot_policy=SnapshotPolicy(stride=4096))
    assert (result.requests[0].cached, result.requests[0].past_snapshot) == (10_752, 0)


def test_replay_refuses_a_stride_that_is_not_whole_blocks(tmp_path, capsys):
    from localinfer.cli import main

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps([{"id": "a", "arrival_ms": 0, "input": 100, "output": 2}]))
    assert main(["replay", str(trace), "--state-size", "1MiB", "--snapshot-stride", "1000"]) != 0
    assert "whole number of 16-token KV blocks" in capsys.readouterr().err
    assert main(["replay", str(trace), "--state-size", "1MiB", "--snapshot-stride", "1000", "--block", "8"]) == 0
