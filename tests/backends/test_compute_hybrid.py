"""The hybrid recurrent graphs' compute buffer (graph_hybrid) against llama.cpp's CPU dry run, to the byte.

Tiny random-weight files of each hybrid family (the layouts tests' TINY specs) are written here; one
subprocess runs llama.cpp's no-alloc dry run over all of them (``benchmarks.fit_accuracy.probe``) and the
predicted compute buffer must equal llama.cpp's for flash attention on and off, one and four sequences,
f16 and q8_0 keys.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf_tools.layouts.hybrid",
                    reason="gguf_tools.layouts.hybrid is not in this branch (it comes with the hybrid layouts)")
try:
    from tests.gguf_tools.test_layouts_hybrid import TINY
except ImportError:                                   # pragma: no cover - the layouts' tests travel with them
    pytest.skip("tests/gguf_tools/test_layouts_hybrid.py (the TINY hybrid specs) is not in this branch",
                allow_module_level=True)

from benchmarks.fit_accuracy import Case, probe  # noqa: E402
from localinfer.backends.llamacpp.compute_buffer import graph_builder  # noqa: E402
from localinfer.backends.llamacpp.memory import breakdown  # noqa: E402
from localinfer.backends.memory import FitRequest  # noqa: E402
from localinfer.devices.profiles import local_device  # noqa: E402
from localinfer.model.spec import ModelSpec  # noqa: E402
from tests.support.ggufgen import write_tiny_arch  # noqa: E402

ARCHS = ("qwen35", "qwen35moe", "qwen3next", "granitehybrid", "granitehybrid-moe", "nemotron_h", "lfm2", "mamba2")
CASES = [Case("512 fa", "tiny", 512, flash_attn=True),
         Case("2048 np=4 fa", "tiny", 2048, n_seq=4, flash_attn=True),
         Case("1024 np=4 no-fa", "tiny", 1024, n_seq=4, flash_attn=False),
         Case("4096 no-fa", "tiny", 4096, flash_attn=False)]
Q8_CASES = [Case("2048 q8_0 fa", "tiny", 2048, type_k="q8_0", type_v="q8_0", flash_attn=True)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(arch, case name): (llama.cpp's compute buffer, predicted)} from one dry-run subprocess."""
    root = tmp_path_factory.mktemp("hybrid")
    paths = {}
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
        pytest.skip(f"no TINY spec for {name}")
    for case, (llama, ours) in rows.items():
        assert llama is not None, f"{name} {case}: llama.cpp's dry run failed: {ours}"
        assert ours == llama, f"{name} {case}: predicted {ours} B, llama.cpp {llama} B ({ours / llama:.4f})"


@pytest.mark.parametrize("name", ARCHS)
def test_hybrid_graph_is_verified(tmp_path, name):
    if name not in TINY:
        pytest.skip(f"no TINY spec for {name}")
    spec = ModelSpec.from_gguf(str(write_tiny_arch(tmp_path / "x.gguf", TINY[name])))
    build, layers, verified = graph_builder(spec)
    assert verified and layers == tuple(range(spec.n_layers))
