"""The glm4moe and llama4 compute buffers (the llama graph's MoE families) against llama.cpp's dry run, to the byte.

glm4moe: a leading dense layer, a shared expert, sigmoid routing with exp_probs_b, partial RoPE, Q/K/V biases and
a NextN layer llama.cpp skips.  llama4: chunked attention (3 chunked layers, 1 full), the no-RoPE layer's
temperature input, L2 Q/K norms, a Hadamard rotation per cache with q8_0 K, the sigmoid weight applied before
the experts, a shared expert.  Each file is written with its layout where this tree has it (skipped otherwise);
llama.cpp plans each context in one subprocess.
"""

import pytest

from benchmarks.fit_accuracy import Case, probe
from localinfer.backends.llamacpp.compute_buffer import graph_builder
from localinfer.backends.llamacpp.memory import breakdown
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import local_device
from localinfer.errors import DryRunError
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_arch

pytest.importorskip("llama_cpp")

SPECS = {
    "glm4moe": {"arch": "glm4moe", "n_layers": 3, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32,
                "n_ff": 256, "n_expert": 4, "n_expert_used": 2, "expert_ff": 64, "n_dense_lead": 1,
                "n_expert_shared": 1, "nextn_layers": 1, "vocab_size": 1},
    "llama4": {"arch": "llama4", "n_layers": 4, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 64,
               "n_ff": 256, "n_expert": 4, "n_expert_used": 1, "expert_ff": 64, "n_expert_shared": 1,
               "vocab_size": 1},
}
CASES = [Case("1024 fa", "x", 1024), Case("2048 np4 no-fa", "x", 2048, n_seq=4, flash_attn=False),
         Case("4096 q8_0 fa", "x", 4096, type_k="q8_0", type_v="q8_0")]


def _layouts() -> tuple[str, ...]:
    from gguf_tools.layouts import archs

    return archs()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(arch, case name): (path, case, llama.cpp's compute bytes)} for the archs this tree can write."""
    names = [a for a in SPECS if a in _layouts()]
    if not names:
        pytest.skip("no glm4moe/llama4 layout in gguf_tools.layouts")
    root = tmp_path_factory.mktemp("moe")
    paths = {a: str(write_tiny_arch(root / f"{a}.gguf", SPECS[a])) for a in names}
    out = {}
    for name, rows in zip(names, probe([(paths[a], CASES) for a in names], timeout=300)):
        for case, row in zip(CASES, rows):
            assert not isinstance(row, DryRunError), f"{name} {case.name}: llama.cpp gave no breakdown ({row})"
            out[name, case.name] = (paths[name], case, sum(b.compute for b in row.buffers))
    return out


@pytest.mark.parametrize("key", [(a, c.name) for a in SPECS for c in CASES], ids=" ".join)
def test_compute_buffer_matches_llama_cpp(measured, key):
    if key not in measured:
        pytest.skip(f"no {key[0]} layout in gguf_tools.layouts")
    path, case, want = measured[key]
    req = FitRequest(n_ctx=case.n_ctx, n_seq=case.n_seq, flash_attn=case.flash_attn, type_k=case.type_k,
                     type_v=case.type_v, mmap=False)
    spec = ModelSpec.from_gguf(path)
    assert graph_builder(spec)[2]
    assert breakdown(spec, local_device(), req)[0].compute == want
