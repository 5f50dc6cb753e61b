"""Skeleton GGUFs: exact tensor bytes, llama.cpp's type mixes, readable everywhere, sparse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import pytest
from gguf import GGMLQuantizationType as T

from gguf_tools import read_header
from gguf_tools.mix import ModelShape, choose_types
from gguf_tools.presets import PRESETS, list_presets
from gguf_tools.quants import layout
from gguf_tools.skeleton import plan_tensors, resolve_spec, write_skeleton
from localinfer.cli import main
from localinfer.units import GiB, MiB


def _split(header):
    codes = meta = 0
    for t in header.tensors:
        c, m = layout(t.type).split(t.n_bytes)
        codes, meta = codes + c, meta + m
    return codes, meta


def test_qwen3_8b_bf16_matches_spec_instance(tmp_path):
    h = read_header(write_skeleton("qwen3-8b", tmp_path / "q.gguf", type="bf16"))
    assert h.tensor_bytes == 16_381_470_720                          # SPEC "The example instance"
    matrices = h.tensor_bytes - h.tensor("token_embd.weight").n_bytes
    assert matrices == 15_136_811_008                                # D_w: embedding looked up by row
    assert round(h.tensor_bytes / GiB, 1) == 15.3
    assert h.data_offset + h.data_size == h.file_size


def test_qwen3_235b_q2_k_reproduces_section_8_4(tmp_path):
    h = read_header(write_skeleton("qwen3-235b-a22b", tmp_path / "big.gguf"))
    codes, meta = _split(h)
    assert codes == 69_178_275_840                                   # codes + unquantized floats
    assert meta == 16_506_720_256                                    # quantization metadata
    assert h.tensor_bytes == 85_691_002_112 - 6_006_016              # file minus header/padding
    # the skeleton's header holds no vocabulary, so it is far smaller than the real 6,006,016 bytes
    assert h.file_size - h.tensor_bytes < 6_006_016


def test_ud_q2_k_xl_approximation_size(tmp_path):
    h = read_header(write_skeleton("qwen3-235b-a22b-ud-q2_k_xl", tmp_path / "ud.gguf"))
    with_real_header = h.tensor_bytes + 6_006_016
    assert abs(with_real_header / GiB - 81.97) < 0.005 * 81.97
    base = read_header(write_skeleton("qwen3-235b-a22b", tmp_path / "base.gguf"))
    assert h.tensor_bytes > base.tensor_bytes


def test_q2_k_mix_follows_llama_quantize_rules():
    plan = {n: t for n, _, t, _ in plan_tensors(resolve_spec("qwen3-8b"), "q2_k")}
    assert plan["token_embd.weight"] == T.Q2_K
    assert plan["output.weight"] == T.Q6_K
    assert plan["blk.0.attn_q.weight"] == plan["blk.0.attn_k.weight"] == T.Q2_K
    assert plan["blk.0.attn_v.weight"] == T.Q4_K                     # n_gqa = 4
    assert plan["blk.7.attn_output.weight"] == plan["blk.7.ffn_down.weight"] == T.Q3_K
    assert plan["blk.7.ffn_gate.weight"] == plan["blk.7.ffn_up.weight"] == T.Q2_K
    assert plan["blk.7.attn_q_norm.weight"] == plan["output_norm.weight"] == T.F32
    moe = {n: t for n, _, t, _ in plan_tensors(resolve_spec("qwen3-235b-a22b"), "q2_k")}
    assert moe["blk.3.ffn_gate_inp.weight"] == T.F32
    assert moe["blk.3.ffn_down_exps.weight"] == T.Q3_K
    assert moe["blk.3.ffn_up_exps.weight"] == T.Q2_K


def test_gqa_below_4_and_fallbacks():
    shape = ModelShape(n_layers=8, n_head=8, n_head_kv=8)
    tensors = [("blk.0.attn_v.weight", (4096, 4096)), ("blk.0.ffn_down.weight", (11008 + 32, 4096)),
               ("output.weight", (4096 + 32, 32000)), ("blk.0.ffn_up.weight", (4096 + 16, 11008))]
    types = choose_types(tensors, "q2_k", shape)
    assert types == [T.Q3_K, T.Q4_0, T.Q8_0, T.F16]                  # Q3_K→Q4_0, Q6_K→Q8_0, →F16
    with pytest.raises(ValueError, match="block size"):
        choose_types([("blk.0.attn_q.weight", (4096 + 16, 4096))], "q4_0", shape)


def test_q4_k_m_uses_more_bits_pattern():
    spec = resolve_spec("llama-3.1-8b")
    plan = {n: t for n, _, t, _ in plan_tensors(spec, "q4_k_m")}
    six = [il for il in range(32) if plan[f"blk.{il}.ffn_down.weight"] == T.Q6_K]
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert {plan[f"blk.{il}.attn_v.weight"] for il in six} == {T.Q6_K}
    assert plan["blk.4.ffn_down.weight"] == plan["blk.4.attn_q.weight"] == T.Q4_K
    assert plan["rope_freqs.weight"] == T.F32


def test_smollm2_skeleton_matches_the_embedded_model(tmp_path, default_model):
    real = read_header(default_model)
    sk = read_header(write_skeleton("smollm2-135m", tmp_path / "s.gguf", type="q4_1"))
    want = {t.name: (t.shape, t.type) for t in real.tensors}
    got = {t.name: (t.shape, t.type) for t in sk.tensors}
    assert got == want
    assert sk.tensor_bytes == real.tensor_bytes


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_reads_in_gguf_reader_and_is_sparse(tmp_path, preset):
    path = write_skeleton(preset, tmp_path / f"{preset}.gguf")
    ours = read_header(path)
    theirs = gguf.GGUFReader(path)
    assert [t.name for t in theirs.tensors] == [t.name for t in ours.tensors]
    for a, b in zip(theirs.tensors, ours.tensors, strict=True):
        assert (tuple(int(x) for x in a.shape), a.tensor_type, int(a.n_bytes)) == (b.shape, b.type, b.n_bytes)
        assert int(a.data_offset) == b.file_offset
    st = os.stat(path)
    assert st.st_size == ours.file_size
    if st.st_size > 64 * MiB:
        assert st.st_blocks * 512 < 4 * MiB                            # the data section is a hole
    assert ours.get("tokenizer.ggml.model") == "none"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_spec_file_toml_and_json_equal_preset(tmp_path):
    spec = {k: v for k, v in PRESETS["qwen3-8b"].items() if k not in ("types",)}
    (tmp_path / "m.json").write_text(json.dumps(spec))
    toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in spec.items())
    (tmp_path / "m.toml").write_text(toml)
    from gguf_tools.skeleton import load_spec_file

    a = plan_tensors(resolve_spec(load_spec_file(tmp_path / "m.json")), "q4_0")
    b = plan_tensors(resolve_spec(load_spec_file(tmp_path / "m.toml")), "q4_0")
    assert a == b == plan_tensors(resolve_spec("qwen3-8b"), "q4_0")


@pytest.mark.parametrize("bad, match", [
    ({"arch": "qwen3", "n_layers": 2}, "'n_embd' is required"),
    ({**PRESETS["qwen3-8b"], "n_layer": 3}, "unknown spec field"),
    ({**PRESETS["qwen3-8b"], "n_head_kv": 5}, "not divisible"),
    ({**PRESETS["qwen3-8b"], "arch": "gpt9"}, "skeletons support"),
    ({**PRESETS["qwen3-8b"], "n_layers": "36"}, "must be int"),
    ({**PRESETS["qwen3-235b-a22b"], "n_expert_used": 0}, "MoE spec"),
])
def test_bad_specs_name_the_field(bad, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        write_skeleton(bad, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())


def test_failed_write_keeps_existing_file(tmp_path):
    out = tmp_path / "keep.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(ValueError):
        write_skeleton("qwen3-8b", out, type="q9_9")
    assert out.read_bytes() == b"precious"


def test_cli_list_and_write(tmp_path, capsys):
    assert main(["skeleton", "--list"]) == 0
    listed = capsys.readouterr().out
    for key, *_ in list_presets():
        assert key in listed
    out = tmp_path / "q.gguf"
    assert main(["skeleton", "qwen3-8b", "--type", "q8_0", "-o", str(out)]) == 0
    assert read_header(out).get("general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert main(["skeleton", "qwen3-8b", "-o", str(out)]) == 2         # exists, no --force
    assert "--force" in capsys.readouterr().err


_LLAMA_DRY_RUN = textwrap.dedent("""
    import sys, llama_cpp as L
    L.llama_backend_init()
    p = L.llama_model_default_params()
    p.no_alloc = True
    p.load_mode = L.LLAMA_LOAD_MODE_NONE
    p.use_extra_bufts = False
    p.n_gpu_layers = 0
    m = L.llama_model_load_from_file(sys.argv[1].encode(), p)
    if not m:
        sys.exit(5)
    print(L.llama_model_n_params(m), L.llama_model_size(m), L.llama_vocab_n_tokens(L.llama_model_get_vocab(m)))
    L.llama_model_free(m)
""")


@pytest.mark.parametrize("preset, qtype", [("smollm2-135m", "q4_1"), ("qwen3-8b", "q2_k")])
def test_llama_cpp_opens_a_skeleton_without_allocating(tmp_path, preset, qtype):
    pytest.importorskip("llama_cpp")
    path = write_skeleton(preset, tmp_path / "m.gguf", type=qtype)
    h = read_header(path)
    r = subprocess.run([sys.executable, "-c", _LLAMA_DRY_RUN, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    n_params, size, n_vocab = map(int, r.stdout.split())
    assert size == h.tensor_bytes
    assert n_params == sum(t.n_elements for t in h.tensors)
    assert n_vocab == h.get(f"{h.architecture}.vocab_size")


def test_cli_spec_file(tmp_path, capsys):
    spec = tmp_path / "tiny.toml"
    spec.write_text('arch = "qwen3"\nname = "tiny-qwen3"\nn_layers = 2\nn_embd = 320\nn_head = 4\n'
                    'n_head_kv = 2\nn_ff = 512\nvocab_size = 1000\n')
    out = tmp_path / "tiny.gguf"
    assert main(["skeleton", "--spec", str(spec), "--type", "q4_0", "-o", str(out)]) == 0
    h = read_header(out)
    assert h.get("general.name") == "tiny-qwen3" and h.tensor("blk.1.attn_q_norm.weight").shape == (80,)
    assert h.tensor("output.weight").type == T.Q8_0                  # Q6_K needs rows of 256k: 320 falls back
    assert h.tensor("blk.0.attn_q.weight").type == T.Q4_0
    spec.write_text('arch = "qwen3"\nn_layers = "two"\n')
    assert main(["skeleton", "--spec", str(spec), "-o", str(tmp_path / "bad.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: spec field") and not (tmp_path / "bad.gguf").exists()
