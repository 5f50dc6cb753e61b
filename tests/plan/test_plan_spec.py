"""SPEC §8.6: the A–D comparison, its two variations, exercise 8-9's variant E, and `localinfer plan`.

Inputs: the Qwen3-8B skeleton, the RTX PRO 6000 profile, experiment 8-1's measured steps and
efficiencies (tests/chapter.py), the DFlash drafter's measured memory and TTFT, the workload.
"""

from __future__ import annotations

import json

import pytest

from localinfer.cli import main
from localinfer.plan.planner import LATE, NOT_FIT, ON_TIME, Config, plan
from localinfer.plan.speculation import Drafting
from localinfer.plan.speed import Workload
from localinfer.units import GiB, MiB
from tests.support import chapter
from tests.support.chapter import close

# Experiment 8-5 (DFlash on the same card): process peak 17,706 → 20,894 MiB; TTFT 129.4 → 141.6 ms;
# a round verifies 8 positions and yields 3 tokens on average; its forward fits inside the round.
DFLASH = Drafting("model", expected=3.0, draft_tokens=7, prefill_factor=141.6 / 129.4,
                  memory_bytes=(20_894 - 17_706) * MiB, name="DFlash")
# Exercise 8-9: drafts looked up in a host-memory index: 2 tokens per round, 0.1 ms per query.
LOOKUP = Drafting("lookup", expected=2.0, draft_tokens=4, round_extra_s=0.1e-3)
ABCD = [Config("f16", False, name="A"), Config("f16", True, name="B"), Config("q8_0", False, name="C"),
        Config("f16", True, DFLASH, name="D")]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return chapter.spec(tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def speed(qwen):
    return chapter.speed(qwen)


def _plan(speed, output=256, budget_gib=12, configs=ABCD):
    return plan(speed, Workload(16, 8192, output, 6144, deadline_s=7), budget_gib * GiB, configs)


def test_a_to_d_table(speed):
    p = _plan(speed)
    a, b, c, d = p.outcomes
    assert a.memory_bytes == 19_008 * MiB and a.verdict == NOT_FIT
    assert close(a.timing.prefill.seconds, 7.34) and round(a.timing.prefill.flops / 1e12, 1) == 2137.5
    assert b.memory_bytes == 6048 * MiB and round(b.timing.prefill.seconds, 2) == 2.04
    assert b.timing.steps == 255 and round(b.timing.step.seconds * 1e3, 2) == 27.35
    assert round(b.total_s, 2) == 9.01 and b.verdict == LATE
    assert round(c.memory_bytes / GiB, 2) == 9.86 and close(c.timing.step.seconds * 1e3, 28.26)
    assert close(c.total_s, 14.55) and c.verdict == LATE
    assert d.memory_bytes == 9236 * MiB and round(d.memory_bytes / GiB, 2) == 9.02
    assert round(d.timing.prefill.seconds, 2) == 2.23 and d.timing.steps == 85
    assert round(d.total_s, 2) == 4.56 and d.verdict == ON_TIME
    assert p.best is d
    assert round(d.gpu_s_per_good, 3) == 0.285 and round(d.joules_per_good) == 171


def test_reasons_for_the_losers(speed):
    p = _plan(speed)
    assert p.reasons["A"].startswith("does not fit") and "12.00 GiB" in p.reasons["A"]
    assert p.reasons["B"] == "late: 9.01 s > 7 s deadline"
    assert p.reasons["C"].startswith("late: 14.5")


def test_six_gib_nothing_feasible(speed):
    p = _plan(speed, budget_gib=6)
    verdicts = {o.name: o.verdict for o in p.outcomes}
    assert verdicts == {"A": NOT_FIT, "B": LATE, "C": NOT_FIT, "D": NOT_FIT}
    assert p.best is None
    assert round(p.outcomes[1].memory_bytes / GiB, 2) == 5.91


def test_sixteen_outputs_b_and_d_both_on_time(speed):
    p = _plan(speed, output=16)
    b, d = p.outcomes[1], p.outcomes[3]
    assert (round(b.total_s, 2), round(d.total_s, 2)) == (2.45, 2.37)
    assert b.verdict == d.verdict == ON_TIME and p.best is d
    assert round(b.total_s - d.total_s, 2) == 0.08
    assert round(d.timing.prefill.seconds - b.timing.prefill.seconds, 2) == 0.19


def test_variant_e_context_lookup(speed):
    e = Config("f16", True, LOOKUP, name="E")
    p = _plan(speed, configs=[*ABCD, e])
    out = p.outcomes[4]
    assert out.memory_bytes == 6048 * MiB and out.timing.steps == 128
    assert round(out.timing.step.seconds * 1e3, 2) == 27.45
    assert round(out.total_s, 2) == round(2.04 + 128 * 0.02745, 2) and out.verdict == ON_TIME
    assert p.best.name == "D" and "on time but slower" in p.reasons["E"]
    six = _plan(speed, budget_gib=6, configs=[*ABCD, e])
    assert six.best.name == "E"                          # the only configuration that fits and is on time
    short = _plan(speed, output=16, configs=[*ABCD, e])
    assert short.best.name == "E" and short.best.timing.steps == 8


# ---- the command --------------------------------------------------------------------------------

def _cli(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_command_table_and_choice(qwen, capsys):
    rc, out, _ = _cli(capsys, qwen.path, "--device", "rtx-pro-6000", "--requests", "16", "--input", "8192",
                      "--output", "256", "--shared-prefix", "6144", "--deadline", "7", "--kv-budget", "12GiB",
                      "--acceptance", "0.5")
    assert rc == 0
    assert "does not fit" in out and "late" in out and "on time" in out
    assert "best: " in out and "why not the others:" in out
    assert "context lookup" in out and "weight offload" in out
    assert "fetch from host 14.2 ms" in out and "more than 4.8% of requests" in out      # §8.3.4


def test_plan_command_json(qwen, capsys):
    rc, out, _ = _cli(capsys, qwen.path, "--device", "rtx-pro-6000", "--requests", "16", "--input", "8192",
                      "--shared-prefix", "6144", "--deadline", "7", "--kv-budget", "6GiB", "--json", "--no-offload")
    data = json.loads(out)
    assert rc == (0 if data["best"] else 1)   # nothing feasible exits 1
    assert data["device"] == "rtx-pro-6000" and data["budget_bytes"] == 6 * GiB
    verdicts = {o["name"]: o["verdict"] for o in data["outcomes"]}
    assert set(verdicts.values()) <= {NOT_FIT, LATE, ON_TIME}
    assert data["best"] is None or verdicts[data["best"]] == ON_TIME
    assert all(k in data["reasons"] for k in verdicts if k != data["best"])


@pytest.mark.parametrize("argv, flag", [
    (["--kv-budget", "lots"], "--kv-budget"), (["--acceptance", "1.5"], "--acceptance"),
    (["--draft", "x.gguf"], "--acceptance"), (["--kv", "q3_x"], "--kv"), (["--shared-prefix", "9999"], "--shared-prefix"),
    (["--deadline", "-1"], "--deadline"), (["--device", "no-such-gpu"], None)])
def test_plan_command_bad_input(qwen, capsys, argv, flag):
    rc, out, err = _cli(capsys, qwen.path, "--device", "rtx-pro-6000", *argv)
    assert rc != 0 and out == "" and err.startswith("error: ") and "Traceback" not in err
    if flag:
        assert flag in err
