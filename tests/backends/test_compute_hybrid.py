"""The hybrid recurrent graphs' compute buffer (graph_hybrid) against llama.cpp's CPU dry run, to the byte.

Tiny random-weight files of each hybrid family are written here (the layouts tests' TINY specs, and a
Mamba-1 file the layouts do not write); one subprocess runs llama.cpp's no-alloc dry run over all of them (``benchmarks.fit_accuracy.probe``) and the
predicted compute buffer must equal llama.cpp's for flash attention on and off, one and four sequences,
f16 and q8_0 keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fit_accuracy import Case, probe
from localinfer.backends.llamacpp.compute_buffer import graph_builder
from localinfer.backends.llamacpp.memory import breakdown
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import local_device
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import byte_level_vocab

pytest.importorskip("llama_cpp")


def _tiny_specs() -> dict:
    """The layouts tests' TINY specs, or none where this branch lacks the hybrid layouts."""
    try:
        import gguf_tools.layouts.hybrid  # noqa: F401
        from tests.gguf_tools.test_layouts_hybrid import TINY
    except ImportError:
        return {}
    return TINY


TINY = _tiny_specs()
NO_LAYOUTS = "gguf_tools.layouts.hybrid (and its TINY specs) is not in this branch: it comes with the hybrid layouts"


def _write_mamba(path, E=64, L=3, d_inner=128, d_state=16, dt_rank=4, d_conv=4):
    """A Mamba-1 file (the layouts write none), tensors as llama-model.cpp's LLM_ARCH_MAMBA loads them."""
    from gguf import GGUFWriter

    tokens, types, merges = byte_level_vocab()
    w = GGUFWriter(str(path), "mamba")
    w.add_context_length(4096)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in (("conv_kernel", d_conv), ("inner_size", d_inner), ("state_size", d_state),
                       ("time_step_rank", dt_rank)):
        w.add_uint32(f"mamba.ssm.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(0)

    def tensor(name, *ne):
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(ne))) * 0.02).astype(np.float32))

    tensor("token_embd.weight", E, len(tokens))
    tensor("output_norm.weight", E)
    tensor("output.weight", E, len(tokens))
    for il in range(L):
        p = f"blk.{il}."
        for name, *ne in (("attn_norm.weight", E), ("ssm_in.weight", E, 2 * d_inner),
                          ("ssm_conv1d.weight", d_conv, d_inner), ("ssm_conv1d.bias", d_inner),
                          ("ssm_x.weight", d_inner, dt_rank + 2 * d_state), ("ssm_dt.weight", dt_rank, d_inner),
                          ("ssm_dt.bias", d_inner), ("ssm_a", d_state, d_inner), ("ssm_d", d_inner),
                          ("ssm_out.weight", d_inner, E)):
            tensor(p + name, *ne)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


ARCHS = ("qwen35", "qwen35moe", "qwen3next", "granitehybrid", "granitehybrid-moe", "nemotron_h", "lfm2", "mamba2",
         "mamba")
CASES = [Case("512 fa", "tiny", 512, flash_attn=True),
         Case("2048 np=4 fa", "tiny", 2048, n_seq=4, flash_attn=True),
         Case("1024 np=4 no-fa", "tiny", 1024, n_seq=4, flash_attn=False),
         Case("4096 no-fa", "tiny", 4096, flash_attn=False)]
Q8_CASES = [Case("2048 q8_0 fa", "tiny", 2048, type_k="q8_0", type_v="q8_0", flash_attn=True)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(arch, case name): (llama.cpp's compute buffer, predicted)} from one dry-run subprocess."""
    root = tmp_path_factory.mktemp("hybrid")
    paths = {"mamba": str(_write_mamba(root / "mamba.gguf"))}
    if TINY:
        from tests.support.ggufgen import write_tiny_arch

        for name in ARCHS:
            if name in TINY:
                paths[name] = str(write_tiny_arch(root / f"{name}.gguf", TINY[name]))
    jobs = [(p, CASES + (Q8_CASES if name.startswith("qwen3") else [])) for name, p in paths.items()]
    out = {}
    for (name, path), (_, cases), rows in zip(paths.items(), jobs, probe(jobs, timeout=300)):
        spec = ModelSpec.from_gguf(path)
        for case, row in zip(cases, rows):
            if not row.get("buffers"):
                out[name, case.name] = (None, row.get("error"))
                continue
            req = FitRequest(n_ctx=case.n_ctx, n_seq=case.n_seq, flash_attn=case.flash_attn, mmap=False,
                             type_k=case.type_k, type_v=case.type_v)
            predicted = breakdown(spec, local_device(), req)[0].compute
            out[name, case.name] = (sum(b[2] for b in row["buffers"].values()), predicted)
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_hybrid_compute_buffer_matches_llama_cpp(measured, name):
    rows = {case: v for (arch, case), v in measured.items() if arch == name}
    if not rows:
        pytest.skip(NO_LAYOUTS if not TINY else f"no TINY spec for {name}")
    for case, (llama, ours) in rows.items():
        assert llama is not None, f"{name} {case}: llama.cpp's dry run failed: {ours}"
        assert ours == llama, f"{name} {case}: predicted {ours} B, llama.cpp {llama} B ({ours / llama:.4f})"


@pytest.mark.parametrize("name", ARCHS)
def test_hybrid_graph_is_verified(tmp_path, name):
    if name == "mamba":
        path = _write_mamba(tmp_path / "x.gguf")
    elif name in TINY:
        from tests.support.ggufgen import write_tiny_arch

        path = write_tiny_arch(tmp_path / "x.gguf", TINY[name])
    else:
        pytest.skip(NO_LAYOUTS if not TINY else f"no TINY spec for {name}")
    spec = ModelSpec.from_gguf(str(path))
    build, layers, verified = graph_builder(spec)
    assert verified and layers == tuple(range(spec.n_layers))
