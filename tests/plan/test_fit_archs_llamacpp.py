"""fit's terms for every architecture family, to the byte against llama.cpp's own dry run.

Tiny random-weight models of each family (tests/support/tiny_archs.py) and real-size skeletons of the presets
the issue names, planned by llama.cpp with ``no_alloc`` (localinfer.backends.llamacpp.dryrun: one subprocess for
everything); fit's weights, KV + recurrent state and output buffer must equal llama.cpp's.  Where llama.cpp
refuses a context (an MLA cache of two types, a quantized K whose blocks do not divide the head), fit refuses it
too, with a one-line error naming the flag.
"""

from __future__ import annotations

import pytest

from localinfer.backends.llamacpp.memory import breakdown
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import local_device
from localinfer.errors import DryRunError, UsageError
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_arch
from tests.support.tiny_archs import TINY

pytest.importorskip("llama_cpp")

MIB = 1 << 20
CASES = (FitRequest(n_ctx=512, mmap=False), FitRequest(n_ctx=2048, n_seq=4, flash_attn=False, mmap=False),
         FitRequest(n_ctx=1024, n_seq=2, type_k="q8_0", type_v="q8_0", flash_attn=True, mmap=False),
         FitRequest(n_ctx=4096, n_seq=1, type_k="q8_0", type_v="f16", flash_attn=True, mmap=False))
PRESETS = {"deepseek-v3": "q2_k", "qwen3-next-80b-a3b": "q4_k_m", "glm-4.5-air": "q4_k_m",
           "llama-4-scout-17b-16e": "q4_k_m", "granite-4.0-h-small": "q4_k_m", "gpt-oss-20b": "bf16"}
PRESET_CASES = (FitRequest(n_ctx=32768, mmap=False), FitRequest(n_ctx=8192, n_seq=4, flash_attn=False, mmap=False))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from gguf_tools.skeleton import write_skeleton
    from localinfer.backends.llamacpp.dryrun import DryRunJob, DryRunRequest, run_jobs

    root = tmp_path_factory.mktemp("archs")
    entries = [(name, str(write_tiny_arch(root / f"{name}.gguf", {**spec, "context_length": 8192})), CASES)
               for name, spec in TINY.items()]
    entries += [(name, str(write_skeleton(name, root / f"{name}.gguf", type=t)), PRESET_CASES)
                for name, t in PRESETS.items()]
    jobs = [DryRunJob(path, tuple(DryRunRequest.from_fit(r) for r in cases)) for _, path, cases in entries]
    return {name: (path, cases, res) for (name, path, cases), res in zip(entries, run_jobs(jobs, timeout=600))}


def _check(path: str, req: FitRequest, res) -> None:
    spec = ModelSpec.from_gguf(path)
    if isinstance(res, DryRunError):           # llama.cpp refused the context: so must fit, naming the flag
        assert res.reason == "context", res
        with pytest.raises(UsageError) as err:
            breakdown(spec, local_device(), req)
        assert err.value.flag in ("-ctk", "-ctv")
        return
    bd, _ = breakdown(spec, local_device(), req)
    weights = sum(b.weights for b in res.buffers)
    kv, state = sum(b.kv for b in res.buffers), sum(b.state for b in res.buffers)
    assert bd.weights == weights
    assert bd.kv + bd.state == kv + state                    # one context buffer in llama.cpp's report
    if res.exact_split:
        assert (bd.kv, bd.state) == (kv, state)
    else:                                                     # the state's own figure is the log's 2-decimal MiB
        assert abs(bd.state - state) <= 0.005 * MIB + 1
    assert abs(bd.output - res.output) <= 0.005 * MIB + 1
    assert bd.state > 0 if spec.has_recurrent else bd.state == 0


@pytest.mark.parametrize("name", list(TINY) + list(PRESETS))
def test_weights_kv_state_and_output_equal_llamacpp(measured, name):
    path, cases, results = measured[name]
    for req, res in zip(cases, results):
        _check(path, req, res)


def test_the_cases_llamacpp_refuses_are_refused(measured):
    """At least the two rules llama-context.cpp applies are exercised: MLA with K ≠ V, a head of 16 with q8_0."""
    refused = {name for name, (_, _, res) in measured.items() if any(isinstance(r, DryRunError) for r in res)}
    assert {"deepseek2-mla-lite", "granitehybrid"} <= refused
    assert "qwen3moe" not in refused


def test_mla_caches_k_only_and_hybrids_kv_only_in_attention_layers(measured):
    mla = ModelSpec.from_gguf(measured["deepseek-v3"][0])
    assert mla.rules == "mla" and all(v == 0 for _, v in mla.kv_dims)
    assert {k for k, _ in mla.kv_dims} == {mla.mla.kv_lora_rank + mla.mla.n_rot}
    nxt = ModelSpec.from_gguf(measured["qwen3-next-80b-a3b"][0])
    assert nxt.rules == "hybrid" and len(nxt.recurrent_layers) == 36
    assert sum(1 for d in nxt.kv_dims if d != (0, 0)) == 12
    glm = ModelSpec.from_gguf(measured["glm-4.5-air"][0])
    assert glm.n_layer_nextn == 1 and glm.n_layers == 46 and glm.skipped_bytes > 0
