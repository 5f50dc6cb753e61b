"""MLA and attention-family layouts: tiny random models decode in llama.cpp, preset skeletons load in its dry run.

Every llama.cpp run happens in a subprocess, so a loader crash fails one test instead of killing pytest.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
from gguf import GGMLQuantizationType as T

from gguf_tools import read_header
from gguf_tools.presets import MLA_PRESETS, PRESETS
from gguf_tools.skeleton import plan_tensors, resolve_spec, write_skeleton
from localinfer.units import GiB
from tests.support.ggufgen import write_tiny_arch

pytest.importorskip("llama_cpp")

from tests.support.tiny_archs import ATTENTION as TINY  # noqa: E402

_DECODE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp as L
    llm = L.Llama(sys.argv[1], n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    runs, finite = [], True
    for _ in range(2):
        llm.reset()
        llm.eval(llm.tokenize(b"hello world", add_bos=False))
        out = []
        for _ in range(4):
            row = llm.scores[llm.n_tokens - 1]
            finite &= bool(np.isfinite(row).all())
            out.append(int(np.argmax(row)))
            llm.eval([out[-1]])
        runs.append(out)
    print(json.dumps({"runs": runs, "finite": finite, "n_params": L.llama_model_n_params(llm.model),
                      "size": L.llama_model_size(llm.model)}))
""")

_DRY_RUN = textwrap.dedent("""
    import json, sys
    import llama_cpp as L
    L.llama_backend_init()
    p = L.llama_model_default_params()
    p.no_alloc, p.load_mode, p.use_extra_bufts, p.n_gpu_layers = True, L.LLAMA_LOAD_MODE_NONE, False, 0
    m = L.llama_model_load_from_file(sys.argv[1].encode(), p)
    if not m:
        sys.exit(5)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads = 256, 256, 256, 1
    ctx = L.llama_init_from_model(m, cp)
    if not ctx:
        sys.exit(6)
    print(json.dumps({"n_params": L.llama_model_n_params(m), "size": L.llama_model_size(m)}))
    L.llama_free(ctx)
    L.llama_model_free(m)
""")


def _run(script: str, path) -> dict:
    r = subprocess.run([sys.executable, "-c", script, str(path)], check=False, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sums(path) -> tuple[int, int]:
    h = read_header(path)
    return sum(t.n_elements for t in h.tensors), h.tensor_bytes


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("case", list(TINY))
def test_tiny_model_decodes_greedily_twice_alike(tmp_path, case, qtype):
    path = write_tiny_arch(tmp_path / f"{case}.gguf", TINY[case], qtype=qtype, seed=1)
    got = _run(_DECODE, path)
    assert got["finite"], "non-finite logits"
    assert got["runs"][0] == got["runs"][1] and len(got["runs"][0]) == 4
    assert (got["n_params"], got["size"]) == _sums(path)          # llama.cpp's tensor table is ours


@pytest.mark.parametrize("preset", list(MLA_PRESETS))
def test_preset_skeleton_loads_in_llama_cpp_dry_run(tmp_path, preset):
    path = write_skeleton(preset, tmp_path / f"{preset}.gguf")
    got = _run(_DRY_RUN, path)
    assert (got["n_params"], got["size"]) == _sums(path)


@pytest.mark.parametrize("spec, ftype", [
    ({**PRESETS["deepseek-v3"], "mla_legacy": True}, "q4_k_m"),
    (PRESETS["gpt-oss-20b"], "mxfp4_moe"),
    (PRESETS["glm-4.5-air"], "q2_k"),
], ids=["deepseek-v3-legacy", "gpt-oss-20b-mxfp4_moe", "glm-4.5-air-q2_k"])
def test_other_layouts_and_types_load_in_llama_cpp_dry_run(tmp_path, spec, ftype):
    path = write_skeleton(spec, tmp_path / "m.gguf", type=ftype)
    got = _run(_DRY_RUN, path)
    assert (got["n_params"], got["size"]) == _sums(path)


def test_mla_metadata_in_both_layouts(tmp_path):
    h = read_header(write_skeleton("deepseek-v3", tmp_path / "v3.gguf"))
    a = "deepseek2."
    assert (h.get(a + "attention.head_count_kv"), h.get(a + "attention.key_length"),
            h.get(a + "attention.value_length")) == (1, 512 + 64, 512)
    assert (h.get(a + "attention.key_length_mla"), h.get(a + "attention.value_length_mla")) == (192, 128)
    assert h.tensor("blk.3.attn_k_b.weight").shape == (128, 512, 128)
    assert h.tensor("blk.3.attn_v_b.weight").shape == (512, 128, 128)
    assert h.tensor("blk.3.attn_q_b.weight").shape == (1536, 128 * 192)
    assert h.tensor("blk.2.ffn_down.weight").shape == (18432, 7168)              # 3 leading dense blocks
    assert h.tensor("blk.3.ffn_down_shexp.weight").shape == (2048, 7168)
    assert h.tensor("blk.3.exp_probs_b.bias").shape == (256,)
    assert h.get(a + "expert_gating_func") == 2 and h.get(a + "leading_dense_block_count") == 3
    legacy = read_header(write_skeleton({**PRESETS["deepseek-v3"], "mla_legacy": True}, tmp_path / "old.gguf"))
    assert (legacy.get(a + "attention.head_count_kv"), legacy.get(a + "attention.key_length"),
            legacy.get(a + "attention.value_length")) == (128, 192, 128)
    assert legacy.get(a + "attention.key_length_mla") is None
    assert legacy.tensor("blk.3.attn_kv_b.weight").shape == (512, 128 * (128 + 128))
    # same weights either way: the split is a reshape of kv_b
    assert legacy.tensor("blk.3.attn_kv_b.weight").n_elements == (
        h.tensor("blk.3.attn_k_b.weight").n_elements + h.tensor("blk.3.attn_v_b.weight").n_elements)


def test_lite_mla_writes_plain_attn_q():
    s = resolve_spec({**TINY["deepseek2-mla-lite"], "vocab_size": 1000})
    names = {n for n, *_ in plan_tensors(s, "f32")}
    assert "blk.0.attn_q.weight" in names and "blk.0.attn_q_a.weight" not in names


def test_glm45_air_matches_the_published_tensor_table(tmp_path):
    h = read_header(write_skeleton("glm-4.5-air", tmp_path / "air.gguf"))
    assert len(h.tensors) == 803 and h.get("glm4moe.block_count") == 47      # 46 blocks + the NextN block
    assert h.get("glm4moe.nextn_predict_layers") == 1 and h.get("glm4moe.rope.dimension_count") == 64
    assert h.tensor("blk.46.nextn.eh_proj.weight").shape == (8192, 4096)
    assert h.tensor("blk.46.nextn.embed_tokens.weight").shape == (4096, 151552)
    assert h.tensor("blk.0.ffn_up.weight").shape == (4096, 10944)


def test_mix_rules_for_mla_and_experts():
    plan = {n: t for n, _, t, _ in plan_tensors(resolve_spec("deepseek-v3"), "q4_k_m")}
    assert plan["blk.3.attn_k_b.weight"] == T.Q5_0             # no category; rows of 128 fall back from Q4_K
    assert plan["blk.3.attn_v_b.weight"] == plan["blk.3.attn_kv_a_mqa.weight"] == T.Q4_K
    assert plan["blk.3.attn_q_a.weight"] == plan["blk.3.attn_q_b.weight"] == T.Q4_K
    assert plan["blk.3.ffn_down_shexp.weight"] == T.Q6_K        # ffn_down rules, layer 3 < 61/8: more bits
    assert plan["blk.3.exp_probs_b.bias"] == plan["blk.3.ffn_gate_inp.weight"] == T.F32
    legacy = {n: t for n, _, t, _ in plan_tensors(resolve_spec({**PRESETS["deepseek-v3"], "mla_legacy": True}),
                                                  "q4_k_m")}
    six = [il for il in range(61) if legacy[f"blk.{il}.attn_kv_b.weight"] == T.Q6_K]
    assert six[:3] == [0, 1, 2] and legacy["blk.8.attn_kv_b.weight"] == T.Q4_K   # attn_kv_b counts as V
    oss = {n: t for n, _, t, _ in plan_tensors(resolve_spec("gpt-oss-20b"), "mxfp4_moe")}
    assert oss["blk.0.ffn_down_exps.weight"] == oss["blk.0.ffn_gate_exps.weight"] == T.MXFP4
    assert oss["blk.0.attn_q.weight"] == oss["output.weight"] == oss["token_embd.weight"] == T.Q8_0
    shipped = {n: t for n, _, t, _ in plan_tensors(resolve_spec("gpt-oss-20b"), "bf16")}
    assert shipped["blk.0.ffn_up_exps.weight"] == T.MXFP4 and shipped["blk.0.attn_k.weight"] == T.BF16


@pytest.mark.parametrize("preset, ftype, published_gib, source", [
    ("gpt-oss-120b", "bf16", 60.8, "OpenAI gpt-oss model card: 60.8 GiB checkpoint (MXFP4 experts + BF16)"),
    ("glm-4.5-air", "q8_0", 109.381, "https://huggingface.co/ubergarm/GLM-4.5-Air-GGUF Q8_0 109.381 GiB"),
    ("gpt-oss-20b", "bf16", 13.8e9 / GiB, "https://huggingface.co/unsloth/gpt-oss-20b-GGUF F16 13.8 GB"),
])
def test_sizes_near_published_files(preset, ftype, published_gib, source):
    got = sum(b for *_, b in plan_tensors(resolve_spec(preset), ftype)) / GiB
    assert math.isclose(got, published_gib, rel_tol=0.005), (got, source)


def test_rope_scaling_keys_as_the_converter_writes_them(tmp_path):
    h = read_header(write_skeleton("gpt-oss-20b", tmp_path / "oss.gguf"))
    a = "gpt-oss."
    assert h.get(a + "rope.scaling.type") == "yarn" and h.get(a + "rope.scaling.factor") == 32.0
    assert h.get(a + "rope.scaling.original_context_length") == 4096
    assert (h.get(a + "rope.scaling.yarn_beta_fast"), h.get(a + "rope.scaling.yarn_beta_slow")) == (32.0, 1.0)
    assert h.get(a + "attention.sliding_window") == 128
    assert h.tensor("blk.0.attn_sinks.weight").type == T.F32 and h.tensor("blk.0.ffn_up_exps.bias").type == T.F32
    ds = read_header(write_skeleton("deepseek-v3", tmp_path / "v3.gguf"))
    assert math.isclose(ds.get("deepseek2.rope.scaling.yarn_log_multiplier"), 0.1, rel_tol=1e-6)


@pytest.mark.parametrize("bad, match", [
    ({**TINY["deepseek2-mla-q-lora"], "n_expert_shared": 0}, "n_expert_shared"),
    ({**TINY["deepseek2-mla-q-lora"], "expert_gating": "relu"}, "expert_gating"),
    ({**TINY["deepseek2-mla-q-lora"], "kv_lora_rank": 0}, "kv_lora_rank"),
    ({**TINY["gpt-oss"], "sliding_window": 0}, "sliding_window"),
    ({**TINY["glm4moe"], "n_dense_lead": 9}, "n_dense_lead"),
    ({**TINY["gemma3"], "n_expert": 4}, "dense"),
    ({**TINY["llama4"], "rope_scaling": "ntk"}, "rope_scaling"),
    ({**TINY["deepseek2-nextn"], "nextn_layers": 17}, "more than any model"),
])
def test_bad_family_fields_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        resolve_spec({**bad, "vocab_size": 1000})


@pytest.mark.parametrize("ftype, published_gb", [
    ("q2_k", 6.43), ("q3_k_s", 7.49), ("q3_k_m", 8.13), ("q4_k_s", 9.53), ("q4_k_m", 10.4), ("q5_k_m", 11.9),
    ("q6_k", 14.1), ("q8_0", 16.7), ("f16", 31.4),
])
def test_deepseek_v2_lite_mixes_match_published_files(ftype, published_gb):
    """https://huggingface.co/mradermacher/DeepSeek-V2-Lite-GGUF (static quants; sizes to 3 digits)."""
    got = (sum(b for *_, b in plan_tensors(resolve_spec("deepseek-v2-lite"), ftype)) + 5_000_000) / 1e9
    assert math.isclose(got, published_gb, rel_tol=0.005), got


@pytest.mark.parametrize("ftype, published_gb", [
    ("q2_k", 10.5), ("q3_k_m", 13.4), ("q4_k_s", 15.7), ("q4_k_m", 16.5), ("q5_k_m", 19.3), ("q6_k", 22.2),
    ("q8_0", 28.7),
])
def test_gemma3_27b_mixes_match_published_files(ftype, published_gb):
    """https://huggingface.co/mradermacher/gemma-3-27b-it-GGUF (static quants; sizes to 3 digits)."""
    got = (sum(b for *_, b in plan_tensors(resolve_spec("gemma-3-27b"), ftype)) + 6_000_000) / 1e9
    assert math.isclose(got, published_gb, rel_tol=0.005), got
