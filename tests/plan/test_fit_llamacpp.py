"""fit against llama.cpp's own accounting: the cases of benchmarks/fit_accuracy.py that run in seconds.

llama.cpp (llama-cpp-python, in one subprocess) plans each context as a dry run
and reports its model, KV and compute buffers through llama_get_memory_breakdown;
fit must reproduce weights and KV to the byte, the compute buffer within 5 %
(it replays ggml's allocator, so in practice to the byte), the total within 2 %.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from benchmarks import fit_accuracy as fa
from gguf_tools.skeleton import write_skeleton

pytest.importorskip("llama_cpp")

TINY = dict(n_layers=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, vocab_size=1000,
            context_length=4096)


def write_tiny_gemma3(path, n_layers=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, vocab=1000,
                      window=128):
    """A gemma3 model with sliding-window layers (5 of every 6), zero weights, no vocabulary."""
    w = GGUFWriter(str(path), "gemma3")
    a = "gemma3."
    for key, value in (("block_count", n_layers), ("context_length", 8192), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                       ("attention.head_count_kv", n_head_kv), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("attention.sliding_window", window),
                       ("vocab_size", vocab)):
        w.add_uint32(a + key, value)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(a + "rope.freq_base", 1e6)
    w.add_string("tokenizer.ggml.model", "none")

    def add(name, shape):
        w.add_tensor(name, np.zeros(shape[::-1], dtype=np.float32))

    add("token_embd.weight", (n_embd, vocab))
    for il in range(n_layers):
        b = f"blk.{il}."
        for name, shape in (("attn_norm", (n_embd,)), ("attn_q", (n_embd, n_head * head_dim)),
                            ("attn_k", (n_embd, n_head_kv * head_dim)), ("attn_v", (n_embd, n_head_kv * head_dim)),
                            ("attn_output", (n_head * head_dim, n_embd)), ("attn_q_norm", (head_dim,)),
                            ("attn_k_norm", (head_dim,)), ("post_attention_norm", (n_embd,)),
                            ("ffn_norm", (n_embd,)), ("ffn_gate", (n_embd, n_ff)), ("ffn_up", (n_embd, n_ff)),
                            ("ffn_down", (n_ff, n_embd)), ("post_ffw_norm", (n_embd,))):
            add(b + name + ".weight", shape)
    add("output_norm.weight", (n_embd,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    d = tmp_path_factory.mktemp("fitacc")
    qwen3 = str(write_skeleton(dict(TINY, arch="qwen3", type="q4_0"), d / "qwen3-q4_0.gguf"))
    moe = str(write_skeleton(dict(TINY, arch="qwen3moe", n_ff=0, n_expert=8, n_expert_used=2, expert_ff=128,
                                  type="f16"), d / "moe.gguf"))
    qwen2 = str(write_skeleton(dict(TINY, arch="qwen2", type="q8_0"), d / "qwen2.gguf"))
    gemma = str(write_tiny_gemma3(d / "gemma3.gguf"))
    default = fa.model_path("default", d)
    C = fa.Case
    jobs = [
        (default, [C("smollm2 512 f16 fa=on", "default", 512),
                   C("smollm2 2048 q8_0 fa=on", "default", 2048, "q8_0", "q8_0"),
                   C("smollm2 8192 f16 fa=off", "default", 8192, flash_attn=False),
                   C("smollm2 1024 q4_0 np=3", "default", 1024, "q4_0", "q4_0", n_seq=3),
                   C("smollm2 1000 mmap", "default", 1000, mmap=True)]),
        (qwen3, [C("qwen3 q4_0 mmap (repack)", qwen3, 1024, mmap=True),
                 C("qwen3 q4_0 q8_0/f16 fa=off", qwen3, 2048, "q8_0", "f16", False)]),
        (moe, [C("qwen3moe 1024", moe, 1024), C("qwen3moe 512 ub=128", moe, 512, n_ubatch=128)]),
        (qwen2, [C("qwen2 q8_0 768", qwen2, 768)]),
        (gemma, [C("gemma3 iSWA 2048", gemma, 2048), C("gemma3 iSWA 4096 np=2", gemma, 4096, n_seq=2),
                 C("gemma3 swa_full 1024", gemma, 1024, swa_full=True)]),
    ]
    out = []
    for (path, cases), results in zip(jobs, fa.probe(jobs)):
        out.extend(fa.compare(case, path, res) for case, res in zip(cases, results))
    print("\n" + fa.render(out))
    return {r["case"]: r for r in out}


CASES = ["smollm2 512 f16 fa=on", "smollm2 2048 q8_0 fa=on", "smollm2 8192 f16 fa=off", "smollm2 1024 q4_0 np=3",
         "smollm2 1000 mmap", "qwen3 q4_0 mmap (repack)", "qwen3 q4_0 q8_0/f16 fa=off", "qwen3moe 1024",
         "qwen3moe 512 ub=128", "qwen2 q8_0 768", "gemma3 iSWA 2048", "gemma3 iSWA 4096 np=2",
         "gemma3 swa_full 1024"]


@pytest.mark.parametrize("case", CASES)
def test_weights_and_kv_exact(rows, case):
    r = rows[case]
    assert not r.get("error"), r.get("error")
    assert r["d_weights"] == 0, (r["llama"]["buffers"], r["fit"]["buffers"])
    assert r["d_kv"] == 0


@pytest.mark.parametrize("case", CASES)
def test_compute_output_and_total(rows, case):
    r = rows[case]
    assert not r.get("error"), r.get("error")
    assert abs(r["r_compute"]) <= 0.05
    assert r["output_ok"]
    assert abs(r["r_total"]) <= 0.02
    assert r["ok"]


def test_repack_buffer_is_counted_on_this_cpu(rows):
    r = rows["qwen3 q4_0 mmap (repack)"]
    from localinfer.devices.profiles import local_device

    if "avx2" not in local_device().cpu_features:
        pytest.skip("no AVX2: llama.cpp does not repack Q4_0 here")
    assert "CPU_REPACK" in r["llama"]["buffers"] and r["llama"]["buffers"]["CPU_REPACK"][0] > 0
    assert r["fit"]["buffers"]["CPU_REPACK model"] == r["llama"]["buffers"]["CPU_REPACK"][0]
    assert r["fit"]["buffers"]["CPU_Mapped model"] == r["llama"]["buffers"]["CPU_Mapped"][0]


def test_sliding_window_cache_is_smaller(rows):
    iswa, full = rows["gemma3 iSWA 2048"], rows["gemma3 swa_full 1024"]
    assert iswa["llama"]["kv"] < 2 * full["llama"]["kv"]   # 2048 cells with SWA layers trimmed vs 1024 full
