"""Hybrid recurrent + attention layouts (gguf_tools/layouts/hybrid.py) against real llama.cpp.

Tiny random-weight files of every architecture load and greedy-decode deterministically; every hybrid preset's
skeleton passes llama.cpp's no-alloc dry run with the parameter count our tensor table gives; the quantization
mix follows llama-quant.cpp's counters on hybrids.
"""

from __future__ import annotations

import math

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from gguf_tools.layouts import layout_for
from gguf_tools.presets import HYBRID_PRESETS
from gguf_tools.skeleton import normalize_spec, plan_tensors, resolve_spec, write_skeleton
from tests.support.ggufgen import write_tiny_arch
from tests.support.llama_dry_run import dry_run

llama_cpp = pytest.importorskip("llama_cpp")

from tests.support.tiny_archs import HYBRID as TINY  # noqa: E402

# the prefix of KV (attention) and recurrent layers in each tiny spec
_KV_LAYERS = {"qwen35": 1, "qwen35moe": 1, "qwen3next": 1, "granitehybrid": 1, "granitehybrid-moe": 1,
              "nemotron_h": 1, "lfm2": 1, "mamba2": 0, "qwen35-mtp": 1, "qwen3next-mtp": 1}


def _decode(path, n: int = 5) -> list[list[int]]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    prompt = llm.tokenize(b"hello hybrid world")
    runs = []
    for _ in range(2):
        llm.reset()
        gen = llm.generate(prompt, temp=0.0, top_k=1)
        runs.append([next(gen) for _ in range(n)])
    llm.close()
    return runs


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_model_loads_and_decodes_deterministically(tmp_path, name):
    path = write_tiny_arch(tmp_path / f"{name}.gguf", {**TINY[name], "vocab_size": 1})
    first, second = _decode(path)
    assert first == second
    assert all(0 <= t < 259 for t in first)


@pytest.mark.parametrize("name", ["qwen35", "granitehybrid", "lfm2"])
def test_tiny_quantized_model_decodes(tmp_path, name):
    path = write_tiny_arch(tmp_path / f"{name}.gguf", {**TINY[name], "vocab_size": 1}, qtype=T.Q8_0)
    first, second = _decode(path, n=3)
    assert first == second


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_model_memory_and_params(tmp_path, name):
    spec = {**TINY[name], "vocab_size": 1}
    path = write_tiny_arch(tmp_path / f"{name}.gguf", spec)
    got = dry_run(path, n_ctx=256)
    assert got["loaded"] and got["context"], got.get("log")
    s = normalize_spec({**spec, "vocab_size": 259})
    assert got["n_params"] == sum(math.prod(shape) for _, shape in layout_for(s["arch"]).tensors(s))
    assert got["rs_mib"]                                          # every family keeps a recurrent state
    assert bool(got["kv_mib"]) == bool(_KV_LAYERS[name])          # and all but mamba2 a KV cache


def _state_and_kv_mib(s: dict, n_ctx: int) -> tuple[float, float]:
    """One sequence's recurrent state (llama-hparams.cpp n_embd_r + n_embd_s, f32, per recurrent layer) and f16
    KV cache (attention layers only), in MiB rounded as llama.cpp logs them."""
    if s["arch"] == "lfm2":
        conv, state = s["n_embd"] * (s["ssm_conv_kernel"] - 1), 0
    else:
        conv = (s["ssm_conv_kernel"] - 1) * (s["ssm_inner"] + 2 * s["ssm_groups"] * s["ssm_state"])
        state = s["ssm_state"] * s["ssm_inner"]
    rs = s["layer_pattern"].count("M") * (conv + state) * 4
    kv = s["layer_pattern"].count("*") * n_ctx * 2 * s["n_head_kv"] * s["head_dim"] * 2
    return round(rs / 2**20, 2), round(kv / 2**20, 2)


@pytest.mark.parametrize("preset", sorted(HYBRID_PRESETS))
def test_preset_skeleton_passes_the_no_alloc_dry_run(tmp_path, preset):
    path = write_skeleton(preset, tmp_path / f"{preset}.gguf")
    got = dry_run(path, n_ctx=256)
    assert got["loaded"] and got["context"], got.get("log")
    spec = resolve_spec(preset)
    plan = plan_tensors(spec)
    assert got["n_params"] == sum(math.prod(shape) for _, shape, _, _ in plan)
    assert path.stat().st_size >= sum(nbytes for *_, nbytes in plan)
    # llama.cpp found the recurrent and the attention layers our layer_pattern says
    rs, kv = _state_and_kv_mib(spec, 256)
    assert got["rs_mib"][0] == pytest.approx(rs, abs=0.011)
    assert (got["kv_mib"] or [0.0])[0] == pytest.approx(kv, abs=0.011)     # mamba2 has no KV cache at all


def test_mtp_blocks_follow_the_trunk(tmp_path):
    spec = {**HYBRID_PRESETS["qwen3.5-35b-a3b"], "nextn_layers": 1}
    path = write_skeleton(spec, tmp_path / "mtp.gguf")
    got = dry_run(path, n_ctx=256)
    assert got["loaded"] and got["context"], got.get("log")
    plan = plan_tensors(resolve_spec(spec))
    assert got["n_params"] == sum(math.prod(shape) for _, shape, _, _ in plan)
    assert _kv(path, "qwen35moe.block_count") == [41] and _kv(path, "qwen35moe.nextn_predict_layers") == [1]
    assert _kv(path, "qwen35moe.attention.recurrent_layers")[-1] is False
    names = {name for name, *_ in plan}
    assert {"blk.40.nextn.eh_proj.weight", "blk.40.attn_q.weight", "blk.40.ffn_up_exps.weight"} <= names


def _kv(path, key):
    field = GGUFReader(path).fields[key]
    return [field.parts[i].tolist()[0] for i in field.data]


def test_per_layer_arrays_follow_the_layer_pattern(tmp_path):
    nemo = write_skeleton("nemotron-nano-9b-v2", tmp_path / "n.gguf")
    pattern = resolve_spec("nemotron-nano-9b-v2")["layer_pattern"]
    assert _kv(nemo, "nemotron_h.attention.head_count_kv") == [8 if c == "*" else 0 for c in pattern]
    assert _kv(nemo, "nemotron_h.feed_forward_length") == [15680 if c == "-" else 0 for c in pattern]
    qwen = write_skeleton("qwen3.5-35b-a3b", tmp_path / "q.gguf")
    assert _kv(qwen, "qwen35moe.attention.recurrent_layers") == [(i + 1) % 4 != 0 for i in range(40)]
    assert _kv(qwen, "qwen35moe.rope.dimension_sections") == [11, 11, 10, 0]
    granite = write_skeleton("granite-4.0-h-small", tmp_path / "g.gguf")
    assert _kv(granite, "granitehybrid.attention.head_count_kv") == [8 if i % 10 == 5 else 0 for i in range(40)]


def _types(preset: str, ftype: str) -> dict[str, T]:
    return {name: t for name, _, t, _ in plan_tensors(resolve_spec(preset), ftype)}


def test_ssm_tensors_stay_f32_and_projections_are_quantized():
    types = _types("granite-4.0-h-small", "q4_k_m")
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_conv1d.bias", "blk.0.ssm_a", "blk.0.ssm_d",
                 "blk.0.ssm_dt.bias", "blk.0.ssm_norm.weight", "blk.0.ffn_gate_inp.weight"):
        assert types[name] == T.F32, name
    assert types["blk.0.ssm_in.weight"] == T.Q4_K and types["blk.0.ssm_out.weight"] == T.Q4_K
    lfm = _types("lfm2-1.2b", "q4_k_m")
    assert lfm["blk.0.shortconv.conv.weight"] == T.F32 and lfm["blk.0.shortconv.in_proj.weight"] == T.Q4_K
    qwen = _types("qwen3.5-9b", "q4_k_m")
    for name in ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_conv1d.weight", "blk.0.ssm_norm.weight"):
        assert qwen[name] == T.F32, name
    assert qwen["blk.0.ssm_beta.weight"] == T.Q4_K and qwen["blk.0.attn_gate.weight"] == T.Q4_K


def test_attn_v_bump_counts_attention_layers_not_layer_indices():
    # llama-quant.cpp: use_more_bits(i_attention_wv, n_attention_wv) over the 4 attention layers; by layer index
    # (of 56) all but the first would be bumped.  Rows of 4480 are not K-quant blocks: Q4_K -> Q5_0, Q6_K -> Q8_0.
    types = _types("nemotron-nano-9b-v2", "q4_k_m")
    attn = [i for i, c in enumerate(resolve_spec("nemotron-nano-9b-v2")["layer_pattern"]) if c == "*"]
    assert [types[f"blk.{il}.attn_v.weight"] for il in attn] == [T.Q5_0, T.Q5_0, T.Q8_0, T.Q8_0]
    # dense ffn_down: i_ffn_down counts the FFN layers (rows of 15680: Q6_K -> Q8_0, Q4_K -> Q5_0) of n_layer 56
    downs = sorted((n for n in types if n.endswith("ffn_down.weight")), key=lambda n: int(n.split(".")[1]))
    assert [types[n] == T.Q8_0 for n in downs] == [i < 7 or i >= 49 or (i - 7) % 3 == 2 for i in range(len(downs))]


def test_n_gqa_is_layer_zeros():
    # llama-quant.cpp reads n_gqa() of layer 0: 0 on a Mamba layer, so Q2_K's attn_v stays Q3_K
    assert _types("granite-4.0-h-small", "q2_k")["blk.5.attn_v.weight"] == T.Q3_K
    assert _types("qwen3.5-35b-a3b", "q2_k")["blk.3.attn_v.weight"] == T.Q4_K   # scalar head_count_kv: 16/2


@pytest.mark.parametrize("bad, message", [
    ({**TINY["granitehybrid"], "layer_pattern": "MM*"}, "one of"),
    ({**TINY["nemotron_h"], "layer_pattern": "MX*-"}, "one of"),
    ({**TINY["qwen35"], "ssm_state": 0}, "ssm_state"),
    ({**TINY["granitehybrid"], "ssm_inner": 96}, "2 x n_embd"),
    ({**TINY["lfm2"], "head_dim": 8}, "n_head x head_dim"),
    ({**TINY["qwen35moe"], "n_expert": 0}, "n_expert"),
    ({**TINY["nemotron_h"], "n_expert": 4}, "no experts"),
    ({**TINY["qwen35"], "rope_sections": [2, 1, 1]}, "rope_sections"),
    ({**TINY["mamba2"], "ssm_inner": 1 << 30}, "more than any model"),
    ({**TINY["lfm2"], "nextn_layers": 1}, "MTP"),
])
def test_bad_specs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        normalize_spec({**bad, "vocab_size": 259})
