"""fit's resident figure against the real thing: llama.cpp loads generated GGUFs, the kernel counts the pages.

Each measurement is a subprocess of benchmarks/fit_resident.py: it loads the
model, prefills a full micro-batch, decodes, and reads /proc/self/smaps(_rollup)
(no madvise before the anonymous counts; the mapping's working set is read after
MADV_DONTNEED on the model's own mapping only).  Runs under a memory limit:
tests/backends/test_llamacpp_memlimit.py.
"""

import os
import sys

import pytest
from gguf import GGMLQuantizationType as T

from benchmarks import fit_resident as fr
from localinfer.backends.llamacpp.placement import repackable
from localinfer.devices.profiles import local_device
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_model

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps"),
              pytest.mark.skipif("avx2" not in local_device().cpu_features,
                                 reason="no AVX2: llama.cpp repacks neither Q4_0 nor Q4_K here")]

PAGE = os.sysconf("SC_PAGESIZE")
SLACK = 64 << 10        # allocator rounding of the repack buffer + llama.cpp's tensor-metadata context for it
FAULT_AROUND = 64 << 10  # the kernel maps up to 16 cached neighbours of a faulting page (fault_around_bytes)
CTX = 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("resident-real")
    # 4096-token vocabulary: the Q4_0 output matrix is repacked; the Q4_K model keeps a Q6_K output and Q6_K
    # attn_v, which stay in the mapping and are read every token
    kw = {"n_layers": 4, "n_embd": 512, "n_head": 4, "n_head_kv": 2, "n_ff": 1536, "n_extra_tokens": 4096 - 259}
    return {"q4_0": str(write_tiny_model(d / "q4_0.gguf", qtype=T.Q4_0, **kw)),
            "q4_k": str(write_tiny_model(d / "q4_k.gguf", qtype=T.Q4_K, output_qtype=T.Q6_K,
                                         overrides={"attn_v": T.Q6_K}, **kw))}


@pytest.fixture(scope="module")
def runs(models):
    out = {}
    for name, path in models.items():
        for mode, repack in (("mmap", True), ("mmap", False), ("none", True)):
            m = fr.measure(path, mode=mode, repack=repack, n_ctx=CTX)
            assert "error" not in m, m["error"]
            out[name, mode, repack] = (m, fr.predict(path, mode=mode, repack=repack, n_ctx=CTX))
    return out


def term(bd, buffer):
    return next(t for t in bd.terms if t.buffer == buffer)


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_the_repacked_copy_is_the_anonymous_memory_the_load_adds(runs, name):
    (on, bd), (off, _) = runs[name, "mmap", True], runs[name, "mmap", False]
    repack = term(bd, "CPU_REPACK model").bytes
    assert repack == on["llama_buffers"]["CPU_REPACK"][0]             # llama.cpp's own figure, to the byte
    extra = on["anon_load"] - off["anon_load"] - repack                # smaps counts whole pages
    assert 0 <= extra <= SLACK, (on["anon_load"], off["anon_load"], repack)


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_the_whole_mapping_shows_in_rss_but_only_the_tensors_read_after_load_stay_in_use(runs, models, name):
    m, bd = runs[name, "mmap", True]
    mapped = term(bd, "CPU_Mapped model")
    assert mapped.bytes == m["llama_buffers"]["CPU_Mapped"][0]
    # MAP_POPULATE: every page before pressure; the range rounded out to pages, plus the file's last page
    assert 0 <= m["mapped_rss"] - mapped.bytes <= 3 * PAGE
    n_read = sum(1 for t in ModelSpec.from_gguf(models[name]).tensors
                 if not t.name.startswith("token_embd"))
    allowance = 2 * PAGE * n_read + 3 * 4 * FAULT_AROUND               # page ends; 4 tokens, 3 lookups each
    assert mapped.resident <= m["working_set"] <= mapped.resident + allowance, (m["working_set"], mapped.resident)
    assert m["working_set"] < mapped.bytes // 2                       # the repacked tensors' pages are not read


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_measured_resident_is_fits_figure_plus_llama_cpps_own_bookkeeping(runs, name):
    m, bd = runs[name, "mmap", True]
    bookkeeping = runs[name, "mmap", False][0]["anon_load"]   # vocabulary, tensor metadata: in no buffer
    measured = m["anon_run"] + m["working_set"]
    assert bd.resident_bytes <= measured <= bd.resident_bytes + bookkeeping + (2 << 20) + 12 * FAULT_AROUND
    assert measured < bd.mapped_bytes                          # the old figure (llama.cpp's buffers) overcounts


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_without_mmap_the_weights_are_anonymous_and_one_staged_copy_may_stay(runs, models, name):
    m, bd = runs[name, "none", True]
    bookkeeping = runs[name, "mmap", False][0]["anon_load"]
    weights = bd.sum("weights")
    assert weights == sum(v[0] for v in m["llama_buffers"].values())
    spec = ModelSpec.from_gguf(models[name])
    largest = max(t.n_bytes for t in spec.tensors
                  if len(t.shape) >= 2 and repackable(t.type.name, tuple(t.shape), local_device().cpu_features)
                  and not t.name.startswith("token_embd"))
    assert bd.load_peak == weights + largest
    extra = m["anon_load"] - bookkeeping - weights             # glibc may keep the freed staging copy
    assert -SLACK <= extra <= largest + SLACK, extra
    assert m["mapped_rss"] == 0
    # the anonymous peak while loading: the weights and at most one staged tensor
    assert weights <= m["peak_load"] <= bd.load_peak + bookkeeping + SLACK, (m["peak_load"], bd.load_peak)


def test_mlock_locks_the_whole_mapped_range(models):
    m = fr.measure(models["q4_0"], mode="mmap+mlock", n_ctx=CTX)
    assert "error" not in m, m["error"]
    if not m["locked"]:
        pytest.skip("mlock refused here (RLIMIT_MEMLOCK)")
    bd = fr.predict(models["q4_0"], mode="mmap+mlock", n_ctx=CTX)
    mapped = term(bd, "CPU_Mapped model")
    assert mapped.resident is None and bd.resident_bytes == bd.mapped_bytes
    assert 0 <= m["locked"] - mapped.bytes <= 3 * PAGE


def test_the_engine_loads_as_the_plan_says(models):
    import localinfer

    with localinfer.load(models["q4_0"], ctx=256, threads=1, options={"mmap": False, "repack": False}) as eng:
        log = "\n".join(eng.load_log())
    assert "CPU model buffer size" in log and "CPU_Mapped" not in log and "CPU_REPACK" not in log
    with localinfer.load(models["q4_0"], ctx=256, threads=1) as eng:
        log = "\n".join(eng.load_log())
    assert "CPU_Mapped model buffer size" in log and "CPU_REPACK model buffer size" in log
