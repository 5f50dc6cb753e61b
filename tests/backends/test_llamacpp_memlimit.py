"""fit's resident figure as a memory limit: llama.cpp loads and decodes within it, and fails clearly below it.

The limits: fit's resident figure + a margin must work; fit's anonymous floor (resident
less the mapped bytes read after load, which the kernel may reclaim and read again)
less the margin must fail.  The margin is llama.cpp's bookkeeping outside its buffers,
measured (the anonymous bytes a load adds with repacking off), + SLACK.

Each run is a child process in a memory cgroup of its own (benchmarks/memlimit.py:
created under this process's memory cgroup, removed afterwards).  The child enters
it first, evicts the model file from the page cache (so the mapping's pages are
charged to it), measures what its imports have been charged (its baseline), limits
the cgroup to baseline + budget, then loads the model (mmap, repacking), prefills
512 tokens and decodes (benchmarks/fit_resident.py, ``measure_limited``).  No swap
softens the limit: memory + swap is capped too.
"""

import os
import sys

import pytest
from gguf import GGMLQuantizationType as T

from benchmarks import fit_resident as fr
from benchmarks import memlimit
from localinfer.devices.profiles import local_device
from tests.support.ggufgen import write_tiny_model

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.slow,            # 10-35 s here, by the load: seven loads, five under pressure
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory cgroups are Linux's"),
              pytest.mark.skipif("avx2" not in local_device().cpu_features,
                                 reason="no AVX2: llama.cpp repacks neither Q4_0 nor Q4_K here")]

# beyond the bookkeeping: transient buffers during the prefill, kernel memory, room for the page cache to work;
# 4-6 MiB needed on this machine (docs/memory.md), more than 8 MiB on CI's (an OOM kill at resident + 10.6 MiB)
SLACK = 16 << 20
CTX = 1024
PAGE = os.sysconf("SC_PAGESIZE")


@pytest.fixture(scope="module")
def own_cgroup():
    try:
        return memlimit.own_memcg()
    except memlimit.Unavailable as e:
        pytest.skip(f"no memory cgroup this process may create and limit: {e}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("resident-limit")
    # large enough that the repacked tensors' mapped pages (fit's mapped total less resident: 54 MiB) exceed
    # twice the margin
    kw = {"n_layers": 8, "n_embd": 1024, "n_head": 8, "n_head_kv": 4, "n_ff": 2816, "n_extra_tokens": 4096 - 259}
    return {"q4_0": str(write_tiny_model(d / "q4_0.gguf", qtype=T.Q4_0, **kw)),
            "q4_k": str(write_tiny_model(d / "q4_k.gguf", qtype=T.Q4_K, output_qtype=T.Q6_K,
                                         overrides={"attn_v": T.Q6_K}, **kw))}


@pytest.fixture(scope="module")
def margin(models):
    out = {}
    for name, path in models.items():
        m = fr.measure(path, repack=False, n_ctx=CTX, prompt=8, decode=1)   # only the load counts here
        assert "error" not in m, m["error"]
        out[name] = m["anon_load"] + SLACK
    return out


def no_cgroup_left(own_cgroup) -> bool:
    return not list(own_cgroup[0].glob(f"localinfer-test-{os.getpid()}-*"))


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_llama_cpp_loads_and_decodes_in_fits_resident_figure_plus_a_margin(own_cgroup, models, margin, name):
    bd = fr.predict(models[name], n_ctx=CTX)
    mapped = next(t for t in bd.terms if t.buffer == "CPU_Mapped model")
    budget = bd.resident_bytes + margin[name]
    assert budget < bd.mapped_bytes - margin[name]     # well below what llama.cpp's buffers add up to
    r = fr.measure_limited(models[name], budget, n_ctx=CTX, timeout=180)
    assert r["ok"], r
    assert 0 <= r["baseline"] + budget - r["limit"] < PAGE        # the kernel rounds the limit down to a page
    file_mapped = r["stat"].get("mapped_file", r["stat"].get("file_mapped", 0))
    assert file_mapped > 0                                        # the mapping's pages were charged here
    # the kernel took back the mapped pages nothing reads after loading (the repacked tensors')
    assert r["mapped_rss"] < mapped.bytes // 2, (r["mapped_rss"], mapped.bytes)
    assert no_cgroup_left(own_cgroup)


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_a_limit_below_fits_anonymous_floor_fails(own_cgroup, models, margin, name):
    bd = fr.predict(models[name], n_ctx=CTX)
    floor = fr.floor_bytes(bd)
    assert bd.resident_bytes - floor < margin[name]    # so this limit is also clearly below the resident figure
    r = fr.measure_limited(models[name], floor - margin[name], n_ctx=CTX, timeout=180)
    assert not r["ok"], r
    assert "limited" in r["stages"], r                 # it failed under the limit, not before it was set
    assert (r["rc"] == -9 and r["oom_kills"] >= 1) or "error" in r, r
    assert no_cgroup_left(own_cgroup)


def test_the_cgroup_is_removed_when_the_run_fails(own_cgroup):
    with pytest.raises(RuntimeError), memlimit.child_memcg(64 << 20) as cg:
        assert cg.path.parent == own_cgroup[0] and cg.limit() == 64 << 20
        raise RuntimeError("the caller's run failed")
    assert not cg.path.exists() and no_cgroup_left(own_cgroup)
