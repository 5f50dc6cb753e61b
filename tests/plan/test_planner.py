"""Offload/prefetch (SPEC §8.4.3), prefix-cache value (§8.3.4) and the planner's mechanics."""

from __future__ import annotations

import dataclasses
import math

import pytest

from localinfer.devices.profiles import get_device
from localinfer.errors import UsageError
from localinfer.plan.offload import CompressedTransfer, offload_groups, plan_offload
from localinfer.plan.planner import LATE, NOT_FIT, ON_TIME, Config, choose, evaluate, kv_memory, plan
from localinfer.plan.prefix_value import choose_prefixes, prefix_value
from localinfer.plan.speed import SpeedModel, Workload
from localinfer.units import GB, GiB, MiB
from tests.support import chapter
from tests.support.chapter import close

PLAIN_STEP = chapter.MEASURED_STEP[1]      # the batch-1 2K decode step the chapter compares against


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return chapter.spec(tmp_path_factory.mktemp("planner"))


# ---- §8.4.3: weight offload with prefetch ------------------------------------------------------

def test_ffn_groups_leave_first_every_fourth_layer(qwen):
    groups = offload_groups(qwen)
    assert [g.kind for g in groups[:36]] == ["ffn"] * 36 and groups[36].kind == "attention"
    assert groups[0].bytes == 288 * MiB and len(groups[0].tensors) == 3
    assert [g.layer for g in groups[:9]] == list(range(3, 36, 4))


def test_offload_nine_ffn_layers_memory(qwen):
    dev = chapter.rtx()
    freed = {b: plan_offload(qwen, dev, groups=9, buffers=b) for b in (0, 1, 2)}
    assert freed[0].freed_bytes == 2592 * MiB
    assert [freed[b].net_bytes // MiB for b in (1, 2)] == [2304, 2016]
    assert (freed[1].extra_requests(1152 * MiB), freed[1].extra_requests(1188 * MiB)) == (2, 1)
    assert (freed[2].extra_requests(1152 * MiB), freed[2].extra_requests(1188 * MiB)) == (1, 1)


def test_copy_per_step_over_pcie_misses_the_deadline(qwen):
    p = plan_offload(qwen, chapter.rtx(), groups=9, buffers=2, step_compute_s=PLAIN_STEP)
    assert round(p.freed_bytes / GB, 2) == 2.72
    assert round(p.copy_s_per_step * 1e3, 1) == 42.5
    assert p.step_s == p.copy_s_per_step and not p.copy_hidden       # copy longer than the 26.26 ms step
    assert math.floor(4 / p.step_s) == 94
    assert round(p.copy_s(255), 1) == 10.8 and not p.meets(255, 7.0)
    assert round(p.required_link(255, 1.0) / GB) == 693


def test_nvlink_c2c_hides_the_copy(qwen):
    gh = get_device("gh200")
    p = plan_offload(qwen, gh, groups=9, buffers=2, step_compute_s=PLAIN_STEP)
    assert round(p.copy_s_per_step * 1e3, 1) == 6.0 and round(p.copy_s(255), 2) == 1.54
    assert p.copy_hidden and p.step_s == PLAIN_STEP
    one = dataclasses.replace(p, buffers=1)                           # one buffer serialises copy and compute
    assert one.step_s == pytest.approx(PLAIN_STEP + p.copy_s_per_step)


def test_offload_for_a_byte_target_and_moe_experts_first(qwen, tmp_path_factory):
    p = plan_offload(qwen, chapter.rtx(), free_bytes=2000 * MiB, buffers=2)
    assert len(p.groups) == 9 and p.net_bytes >= 2000 * MiB
    moe = chapter.spec(tmp_path_factory.mktemp("moe"), "qwen3-235b-a22b", "q2_k")
    first = offload_groups(moe)[0]
    assert first.kind == "experts" and all("_exps." in t for t in first.tensors)


def test_offload_refused_on_unified_memory_and_when_impossible(qwen):
    with pytest.raises(UsageError, match="shares memory"):
        plan_offload(qwen, get_device("m2-max-96gb"), groups=1)
    with pytest.raises(UsageError, match="frees only"):
        plan_offload(qwen, chapter.rtx(), free_bytes=100 * GiB)
    with pytest.raises(UsageError):
        plan_offload(qwen, chapter.rtx(), groups=9, buffers=3)


def test_compressed_transfer_break_even():
    t = CompressedTransfer(96 * MiB, 0.25, 64e9)
    assert round(t.raw_s * 1e3, 2) == 1.57 and round(t.wire_s * 1e3, 2) == 0.39
    assert round(t.min_decompress_rate / 1e9, 1) == 85.3
    assert CompressedTransfer(96 * MiB, 0.25, 64e9, 100e9).pays
    slow = CompressedTransfer(96 * MiB, 0.25, 64e9, 80e9)
    assert slow.pays is False and slow.compressed_s > slow.raw_s


# ---- §8.3.4: prefix-cache value ------------------------------------------------------------------

def test_value_of_the_6144_token_prefix(qwen):
    sm = chapter.speed(qwen, calibrated=False)             # batch-1 prefill at the profile's 62% MFU
    a = prefix_value(sm, 6144, 0.5, name="A")
    assert a.bytes == 864 * MiB and round(a.bytes / GB, 3) == 0.906
    assert close(a.recompute_s * 1e3, 307.9)
    assert round(a.fetch_s * 1e3, 1) == 14.2 and a.maintain_s == a.fetch_s
    assert close(a.value_s * 1e3, 132.7)
    assert round(100 * a.break_even_prob, 1) == 4.8
    gen4 = prefix_value(sm, 6144, 0.5, link_bytes_per_s=32e9)
    assert round(gen4.fetch_s * 1e3, 1) == 28.3 and close(gen4.saving_per_hit_s * 1e3, 279.6)
    assert round(100 * gen4.break_even_prob, 1) == 10.1


def test_one_long_prefix_beats_three_short_ones_per_mib(qwen):
    sm = chapter.speed(qwen, calibrated=False)
    a = prefix_value(sm, 6144, 0.5, name="A")
    b = [prefix_value(sm, 2048, 0.5, name=f"B{i}") for i in range(3)]
    assert b[0].bytes == 288 * MiB and close(b[0].recompute_s * 1e3, 94.7)
    assert round(b[0].fetch_s * 1e3, 1) == 4.7 and close(b[0].value_s * 1e3, 40.3)
    assert close(3 * b[0].value_s * 1e3, 120.9)
    assert round(a.value_per_mib_s * 1e3, 3) == 0.154 and round(b[0].value_per_mib_s * 1e3, 3) == 0.140
    kept, total = choose_prefixes([*b, a], 864 * MiB)
    assert [p.name for p in kept] == ["A"] and total == a.value_s


def test_prefix_value_rejects_bad_probability(qwen):
    with pytest.raises(UsageError):
        prefix_value(chapter.speed(qwen, calibrated=False), 100, 1.5)


# ---- planner mechanics ---------------------------------------------------------------------------

def test_kv_memory_reserves_outputs_in_blocks(qwen):
    sm = chapter.speed(qwen, calibrated=False)
    w = Workload(16, 8192, 256, 6144)
    assert kv_memory(sm, w, "f16", False) == 16 * 1188 * MiB == 19_008 * MiB
    assert kv_memory(sm, w, "f16", True) == (864 + 16 * 324) * MiB == 6048 * MiB
    assert kv_memory(sm, w, "q8_0", False) == int(16 * 1188 * MiB * 34 / 64)
    assert round(kv_memory(sm, w, "q8_0", False) / GiB, 2) == 9.86
    assert round(1188 * 34 / 64, 3) == kv_memory(sm, Workload(1, 8192, 256), "q8_0", False) / MiB == 631.125
    assert kv_memory(sm, Workload(35, 8192, 256, 6144), "f16", True) <= 12 * GiB      # 35 instead of 10
    assert kv_memory(sm, Workload(36, 8192, 256, 6144), "f16", True) > 12 * GiB


def test_reasons_name_the_binding_constraint(qwen):
    sm = chapter.speed(qwen)
    w = Workload(16, 8192, 256, 6144, deadline_s=7)
    outs = [evaluate(sm, w, Config("f16", False, name="A"), 12 * GiB),
            evaluate(sm, w, Config("f16", True, name="B"), 12 * GiB),
            evaluate(sm, dataclasses.replace(w, deadline_s=10), Config("f16", True, name="B10"), 12 * GiB)]
    assert [o.verdict for o in outs] == [NOT_FIT, LATE, ON_TIME]
    best, reasons = choose(outs)
    assert best.name == "B10"
    assert "does not fit" in reasons["A"] and "GiB" in reasons["A"]
    assert reasons["B"].startswith("late: 9.01 s > 7 s")


def test_offload_variant_only_when_needed_and_possible(qwen):
    sm = chapter.speed(qwen)
    w = Workload(16, 8192, 256, 6144, deadline_s=30)
    configs = [Config("f16", False), Config("f16", False, offload=True), Config("f16", True),
               Config("f16", True, offload=True)]
    p = plan(sm, w, 12 * GiB, configs, spec=qwen)
    labels = [o.config.label for o in p.outcomes]
    assert "f16 KV, shared prefix, weight offload" not in labels          # the shared one fits already
    off = next(o for o in p.outcomes if o.config.offload)
    assert off.verdict in (ON_TIME, LATE) and off.offload.net_bytes >= off.memory_bytes - 12 * GiB
    assert off.timing.step.seconds >= off.offload.copy_s_per_step
    unified = SpeedModel(sm.cost, get_device("m2-max-96gb"))
    p2 = plan(unified, w, 12 * GiB, configs, spec=qwen)
    assert not any(o.config.offload for o in p2.outcomes)


def test_negative_budget_is_a_usage_error(qwen):
    with pytest.raises(UsageError, match="weights alone"):
        plan(chapter.speed(qwen), Workload(), -1, [Config()])
