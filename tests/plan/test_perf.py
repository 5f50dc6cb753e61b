"""The speed model against SPEC §8.1, §8.2, §8.4.2, §8.5 and §8.6 (inputs built, figures compared)."""

from __future__ import annotations

import math

import pytest

from localinfer.errors import UsageError
from localinfer.model.cost import attention_pairs, model_cost
from localinfer.plan.calibration import Calibration, Curve, DecodeSample, LinearFit, PrefillSample, StepFit
from localinfer.plan.speculation import (
    Drafting,
    choose_draft_length,
    draft_forward_s,
    draft_length_table,
    expected_tokens,
    lookup_break_even,
    mean_token_time,
    padded_rows,
    payback_tokens,
    worth_lengthening,
)
from localinfer.plan.speed import SpeedModel, Workload, amdahl, compression_gain, energy_per_good, gpu_seconds
from localinfer.units import GB, GiB, MiB
from tests.support import chapter
from tests.support.chapter import close


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return chapter.spec(tmp_path_factory.mktemp("perf"))


@pytest.fixture(scope="module")
def cost(qwen):
    return model_cost(qwen)


# ---- §8.2: bytes per token ------------------------------------------------------------------

def test_weights_read_per_step_skip_the_embedding(qwen, cost):
    embd = qwen.tensor("token_embd.weight").n_bytes
    assert cost.decode_read_bytes() == qwen.weight_bytes - embd == 15_136_811_008
    assert cost.kv_token_bytes() == 147_456


def test_per_token_reads_fall_with_batch(cost):
    assert close(cost.decode_read_bytes() / 16 / GiB, 0.88, 0.01)
    assert close(cost.decode_read_bytes() / 64 / GiB, 0.22, 0.01)
    b1, b64 = cost.per_token_read_bytes(1, 2048), cost.per_token_read_bytes(64, 2048)
    assert round(b1 / GiB, 2) == 14.38 and round(b64 / GiB, 2) == 0.50
    assert round(b1 / b64) == 29


def test_batch_where_kv_reads_reach_the_weights(cost):
    assert cost.kv_weight_crossover(2048) == 51
    assert cost.kv_weight_crossover(8192) == 13


def test_64_requests_hold_35_7_gb_after_one_step(qwen, cost):
    assert round((qwen.weight_bytes + 64 * cost.kv_read_bytes(2049)) / GB, 1) == 35.7


def test_efficiency_table_bytes_roofline_and_mbu(cost):
    dev = chapter.rtx()
    printed = {1: (15.44, 8.62, 33), 4: (16.34, 9.12, 34), 16: (19.97, 11.14, 41), 64: (34.46, 19.23, 65)}
    for b, (gb, ms, mbu) in printed.items():
        nbytes = cost.step_bytes(b, 2048)
        assert round(nbytes / GB, 2) == gb
        bound = nbytes / dev.bandwidth_bytes_per_s
        assert round(bound * 1e3, 2) == ms
        assert round(100 * bound / chapter.MEASURED_STEP[b]) == mbu


def test_attention_pairs_of_a_chunk():
    assert attention_pairs(512, 0) == 131_328
    assert attention_pairs(512, 7680) == 4_063_488
    assert attention_pairs(4, 8) == 42
    assert attention_pairs(4, 8, window=6) == 4 * 6          # every query sees only the window
    assert attention_pairs(3, 0, window=2) == 1 + 2 + 2


def test_prefill_flops_count_attention_pairs(cost):
    assert round(cost.prefill_flops(6144) / 1e12, 1) == 96.5
    assert round(16 * cost.prefill_flops(8192) / 1e12, 1) == 2137.5


def test_step_time_roofline_takes_the_larger_term(qwen):
    sm = chapter.speed(qwen, calibrated=False)
    small = sm.decode_step(1, 2048)
    assert small.bound == "memory" and small.source == "profile"
    assert math.isclose(small.seconds, small.bytes / (1792e9 * 0.33))
    big = sm.decode_step(64, 2048, rows=512)            # a prefill-sized step is compute bound
    assert big.bound == "compute" and big.seconds == big.compute_s


def test_chapter_fitted_step_model():
    fit = StepFit(26.22e-3, 30.4e-6, 3e-9)
    assert round(fit.step(1, 2048) * 1e3, 2) == 26.26
    assert round(fit.step(2048) * 1e3, 1) == 94.8


# ---- §8.1 / §8.6: request timeline and cost --------------------------------------------------

def test_request_time_is_queue_plus_ttft_plus_itls(qwen):
    cal = Calibration((DecodeSample.from_request(1, 2048, 256, 26.5e-3),), (PrefillSample(1, 2048, 0.096),))
    sm = SpeedModel(model_cost(qwen), chapter.rtx(), cal)
    t = sm.request(Workload(1, 2048, 256, queue_s=0.1, deadline_s=7))
    assert round(t.ttft_s, 3) == 0.196 and t.steps == 255
    assert round(t.total_s, 2) == 6.95 and t.on_time
    late = sm.request(Workload(1, 2048, 256, queue_s=0.1 + 0.096, deadline_s=7))   # one interleaved prefill
    assert round(late.total_s, 2) == 7.05 and late.on_time is False


def test_gpu_seconds_per_request_shared_prefix_batch(qwen):
    t = chapter.speed(qwen).request(Workload(16, 8192, 256, 6144))
    assert t.prefill.source == "measured" and t.step.source == "measured"
    assert close(t.prefill_tok_s, 16_059) and round(16 / t.step.seconds) == 585
    per_request = gpu_seconds(2048, t.prefill_tok_s, 256, 16 / t.step.seconds)
    assert round(per_request, 3) == 0.563 and math.isclose(per_request, t.gpu_s_per_request)
    assert round(16 * per_request, 2) == 9.01
    assert round(t.prefill.flops / t.prefill.seconds / 503.8e12, 2) == 0.58


def test_energy_per_good_result():
    assert round(energy_per_good(4.56, 16, 600)) == 171
    assert energy_per_good(9.01, 0, 600) == math.inf


def test_amdahl():
    assert amdahl(100, 50, 4) == 62.5 and round(100 / 62.5, 1) == 1.6
    assert amdahl(100, 20, 4) == 85 and round(100 / 85, 2) == 1.18


# ---- §8.4.2: compressed KV ---------------------------------------------------------------------

def test_compressed_kv_pays_only_if_conversion_is_short(qwen, cost):
    saved = cost.kv_read_bytes(8192) - cost.kv_read_bytes(8192, "q8_0")
    assert saved == 540 * MiB
    beta = chapter.speed(qwen, calibrated=False).effective_bandwidth(64)     # 65% of 1792 GB/s
    assert round(beta / 1e12, 2) == 1.16
    for convert_ms, printed in ((0, 0.487), (0.2, 0.287), (0.8, -0.313)):
        assert close(compression_gain(saved, beta, convert_ms / 1e3) * 1e3, printed)


def test_fp8_kv_crossover_from_fitted_itl_lines():
    bf16, fp8 = LinearFit(6.44, 4.37e-5), LinearFit(6.58, 2.37e-5)
    assert round(bf16.crossover(fp8), -2) == 7000
    assert (round(bf16.at(2048), 2), round(fp8.at(2048), 2)) == (6.53, 6.63)
    assert (round(bf16.at(16384), 2), round(fp8.at(16384), 2)) == (7.16, 6.97)
    fitted = LinearFit.fit([(x, bf16.at(x)) for x in (1024, 4096, 16384)])
    assert math.isclose(fitted.slope, 4.37e-5) and math.isclose(fitted.fixed, 6.44)


# ---- calibration -----------------------------------------------------------------------------

def test_curve_interpolates_and_extrapolates_by_efficiency():
    c = Curve([(1.0, 2.0), (3.0, 3.0)])
    assert c(2.0) == 2.5
    assert c(6.0) == 6.0                           # above: the last point's efficiency
    assert c(0.5) == 1.75                          # below: the first segment's line
    assert Curve([(2.0, 4.0)])(3.0) == 6.0


def test_q8_kv_step_interpolated_between_measured_batches(qwen, cost):
    """C's step: 25.40 GB per step lies between the measured 19.97 and 34.46 GB rows."""
    sm = chapter.speed(qwen)
    assert round(cost.step_bytes(16, 8192, "q8_0") / GB, 2) == 25.40
    step = sm.decode_step(16, 8192, "q8_0")
    assert step.source == "calibrated" and round(step.seconds * 1e3, 2) == 28.26


def test_calibrated_verify_rows_cost_compute_only_when_larger(qwen, cost):
    sm = chapter.speed(qwen)
    verify = sm.decode_step(16, 8192, rows=8, shared_prefix=6144)     # D: 16 requests × 8 positions
    assert round(verify.flops / 1e12, 2) == 2.56 and round(verify.compute_s * 1e3, 1) == 8.8
    assert verify.seconds == pytest.approx(chapter.SHARED_STEP_S, rel=0.01)
    extra = 4 * cost.token_flops(2048)                                   # §8.5: 4 more rows at batch 1
    assert round(extra / 1e9) == 65 and round(extra / (0.62 * 503.8e12) * 1e3, 1) == 0.2


def test_uncalibrated_local_machine_is_unknown_not_invented(qwen):
    from localinfer.devices.profiles import local_device

    sm = SpeedModel(model_cost(qwen), local_device())
    assert math.isnan(sm.decode_step(1, 512).seconds) and sm.decode_step(1, 512).source == "unknown"


# ---- §8.5: speculative decoding ------------------------------------------------------------------

def test_expected_tokens_and_time_per_token(qwen):
    verify = chapter.speed(qwen).decode_step(1, 2048, rows=5).seconds
    assert round(verify * 1e3, 2) == 26.26                  # five positions cost a plain step
    for a, n_printed, ms_printed, even_printed in ((0.25, 1.33, 19.8, 8.7), (0.75, 3.05, 8.64, 53.9)):
        d = Drafting.lookup(a, draft_tokens=4, query_s=0.1e-3)
        assert round(d.expected, 2) == n_printed
        per_token = (verify + d.round_extra_s) / d.expected
        assert close(per_token * 1e3, ms_printed)
        assert round(lookup_break_even(verify, verify, d.expected) * 1e3, 1) == even_printed


def test_index_build_payback_and_256_tokens(qwen):
    plain = chapter.speed(qwen).decode_step(1, 2048).seconds
    spec = (plain + 0.1e-3) / Drafting.lookup(0.75, 4).expected
    assert payback_tokens(2.0, plain, spec) == 114
    assert round(256 * plain, 2) == 6.72
    assert close(2.0 + 256 * spec, 4.22)


def test_mean_token_time_weights_rounds_by_tokens():
    assert mean_token_time([(1.5e-3, 1), (1.5e-3, 5)]) == pytest.approx(0.5e-3)


def test_draft_network_serial_vs_parallel(qwen, cost):
    sm = chapter.speed(qwen)
    step = sm.decode_step(1, 2048)
    achieved = step.bytes / step.seconds
    assert round(achieved / 1e9) == 588
    fwd = draft_forward_s(int(2.10e9), achieved)
    assert round(fwd * 1e3, 2) == 3.57 and close(4 * fwd * 1e3, 14.28)
    assert round((4 * fwd + step.seconds) / 3 * 1e3, 1) == 13.5
    assert round((fwd + step.seconds) / 3 * 1e3, 1) == 9.9
    assert round((fwd + step.seconds) / 2 * 1e3, 1) == 14.9


def test_exercise_8_7_draft_length():
    a = [0.75] * 8
    rows = draft_length_table(a, lambda m: 26.3 + 3.6 * m, (1, 2, 4, 8))
    assert [round(r.per_token_s, 1) for r in rows] == [17.1, 14.5, 13.3, 14.9]
    assert min(rows, key=lambda r: r.per_token_s).length == 4
    assert choose_draft_length(a, lambda m: 26.3 + 3.6 * m, (1, 2, 4, 8)) == 4
    grouped = lambda m: 26.3 + 14.4 * math.ceil(m / 4)
    r4, r5 = draft_length_table(a, grouped, (4, 5))
    assert round(r4.per_token_s, 1) == 13.3 and round(r5.per_token_s, 1) == 16.8
    assert not worth_lengthening(r4.round_s, r4.expected, r5.round_s, r5.expected)
    assert choose_draft_length(a, grouped, range(1, 9)) == 4


def test_padding_to_graph_shapes_makes_the_cost_jump(qwen):
    sm = chapter.speed(qwen, calibrated=False)
    assert padded_rows(8) == 8 and padded_rows(9) == 16
    cost_of = lambda m: sm.decode_step(64, 2048, rows=padded_rows(m + 1)).seconds
    assert cost_of(7) < cost_of(8) and cost_of(8) == cost_of(15)
    assert expected_tokens([0.75] * 4) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3 + 0.75**4)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, flag", [({"requests": 0}, "--requests"), ({"input_tokens": -1}, "--input"),
                                      ({"output_tokens": 2**40}, "--output"),
                                      ({"shared_prefix": 600, "input_tokens": 512}, "--shared-prefix"),
                                      ({"deadline_s": float("nan")}, "--deadline"),
                                      ({"requests": True}, "--requests")])
def test_workload_rejects_bad_numbers(kw, flag):
    with pytest.raises(UsageError) as e:
        Workload(**kw)
    assert e.value.flag == flag


def test_unknown_kv_type_names_the_choices(cost):
    with pytest.raises(UsageError, match="q3_x") as e:
        cost.kv_token_bytes("q3_x")
    assert "q8_0" in e.value.hint and e.value.flag == "--kv"
    with pytest.raises(UsageError):
        Drafting.lookup(1.5)


def test_moe_reads_only_touched_experts(tmp_path_factory):
    moe = model_cost(chapter.spec(tmp_path_factory.mktemp("moe"), "qwen3-235b-a22b", "q2_k"))
    one, many = moe.decode_read_bytes(1), moe.decode_read_bytes(512)
    assert one < many <= moe.dense_read_bytes + moe.expert_bytes
    assert math.isclose(one - moe.dense_read_bytes, moe.expert_bytes * 8 / 128, rel_tol=1e-6)
    assert 20e9 < moe.matmul_params + moe.head_params < 23e9          # "A22B": about 22B active
