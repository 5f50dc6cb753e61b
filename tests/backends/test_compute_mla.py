"""The deepseek2 compute buffer (graph_mla) against llama.cpp's own dry run, to the byte.

Tiny random-weight files of the three deepseek2 layouts (MLA without q_lora as V2-Lite, MLA with q_lora,
sigmoid gating and exp_probs_b as V3, the legacy unsplit attn_kv_b) are written with the MLA layout; llama.cpp
(one subprocess, ``benchmarks.fit_accuracy.probe``) plans each context and reports its compute buffer, which the
replayed graph must equal with flash attention on and off, one and four sequences.
"""

import pytest

from benchmarks.fit_accuracy import Case, probe
from gguf_tools.layouts import archs
from localinfer.backends.llamacpp.compute_buffer import graph_builder
from localinfer.backends.llamacpp.memory import breakdown
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import local_device
from localinfer.errors import DryRunError
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_arch

pytest.importorskip("llama_cpp")
if "deepseek2" not in archs():     # the registry, not the module: importing one family first hides the others
    pytest.skip("the MLA layout (gguf_tools.layouts.mla) is not in this tree", allow_module_level=True)

_BASE = {"arch": "deepseek2", "n_layers": 3, "n_embd": 128, "n_head": 4, "n_ff": 256, "n_expert": 4,
         "n_expert_used": 2, "expert_ff": 64, "n_dense_lead": 1, "n_expert_shared": 1, "kv_lora_rank": 64,
         "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 1}
SPECS = {
    "lite": _BASE,
    "v3": {**_BASE, "q_lora_rank": 96, "expert_probs_bias": True, "expert_gating": "sigmoid"},
    "legacy": {**_BASE, "mla_legacy": True},
    "groups": {**_BASE, "q_lora_rank": 96, "n_expert": 16, "n_expert_used": 3, "n_expert_shared": 2,
               "expert_probs_bias": True, "expert_gating": "sigmoid", "expert_weights_norm": True,
               "expert_weights_scale": 2.5, "n_expert_groups": 4, "n_group_used": 2},
}
CASES = {
    "lite": [Case("2048 fa", "x", 2048), Case("4096 np4 no-fa", "x", 4096, n_seq=4, flash_attn=False)],
    "v3": [Case("1024 np4 fa", "x", 1024, n_seq=4), Case("2048 no-fa", "x", 2048, flash_attn=False)],
    "legacy": [Case("2048 no-fa", "x", 2048, flash_attn=False), Case("1024 np4 fa", "x", 1024, n_seq=4)],
    "groups": [Case("1024 fa", "x", 1024), Case("1024 np4 no-fa", "x", 1024, n_seq=4, flash_attn=False)],
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(file, case name): (path, case, llama.cpp's compute bytes)} from one llama.cpp subprocess."""
    root = tmp_path_factory.mktemp("mla")
    paths = {name: str(write_tiny_arch(root / f"{name}.gguf", spec)) for name, spec in SPECS.items()}
    jobs = [(paths[name], CASES[name]) for name in SPECS]
    out = {}
    for (name, rows) in zip(SPECS, probe(jobs, timeout=300)):
        for case, row in zip(CASES[name], rows):
            assert not isinstance(row, DryRunError), f"{name} {case.name}: llama.cpp gave no breakdown ({row})"
            out[name, case.name] = (paths[name], case, sum(b.compute for b in row.buffers))
    return out


def _predicted(path: str, case: Case) -> int:
    req = FitRequest(n_ctx=case.n_ctx, n_seq=case.n_seq, flash_attn=case.flash_attn, type_k=case.type_k,
                     type_v=case.type_v, mmap=False)
    return breakdown(ModelSpec.from_gguf(path), local_device(), req)[0].compute


@pytest.mark.parametrize("key", [(name, c.name) for name in SPECS for c in CASES[name]], ids=" ".join)
def test_compute_buffer_matches_llama_cpp(measured, key):
    path, case, want = measured[key]
    assert _predicted(path, case) == want


def test_deepseek2_uses_the_verified_mla_graph(measured):
    path = next(iter(measured.values()))[0]
    _, layers, verified = graph_builder(ModelSpec.from_gguf(path))
    assert verified and layers == (0, 1, 2)
