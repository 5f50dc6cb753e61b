"""gpt-oss-20b's CPU compute buffer at real size with flash attention, against llama.cpp's dry run, to the byte.

With flash attention the peak is the output stage: the logits (201088 × 512 f32) placed above whatever is live
or fragmenting the arena there.  openai-moe.cpp keeps every row through the last layer, marks that layer's
output a graph output (``t_h_nextn``, never freed) and takes the output rows after the trunk, so where the
logits land depends on where the KV masks fell earlier: llama.cpp's buffer is not monotonic in the context
(434.5 MB at 4K, 456.4 MB at 8K, 429.5 MB from 16K on).  A real-size skeleton (sparse, no weights) is planned
by llama.cpp in one subprocess; the pinned numbers are llama-cpp-python 0.3.36's, so the prediction is checked
without llama.cpp too.
"""

import pytest

from localinfer.backends.llamacpp.memory import breakdown
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import local_device
from localinfer.model.spec import ModelSpec

CONTEXTS = (4096, 8192, 32768)
LLAMA_CPP_0_3_36 = {4096: 434_526_208, 8192: 456_415_232, 32768: 429_524_992}   # CPU compute bytes, FA on


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory):
    from gguf_tools.skeleton import write_skeleton

    return str(write_skeleton("gpt-oss-20b", tmp_path_factory.mktemp("gptoss") / "gpt-oss-20b.gguf"))


def _predicted(path: str, n_ctx: int) -> int:
    req = FitRequest(n_ctx=n_ctx, flash_attn=True, mmap=False)
    return breakdown(ModelSpec.from_gguf(path), local_device(), req)[0].compute


def test_prediction_matches_the_measured_buffers(skeleton):
    assert {c: _predicted(skeleton, c) for c in CONTEXTS} == LLAMA_CPP_0_3_36


def test_compute_buffer_matches_llama_cpp(skeleton):
    pytest.importorskip("llama_cpp")
    from localinfer.backends.llamacpp.dryrun import DryRunJob, DryRunRequest, run_jobs

    reqs = tuple(DryRunRequest.from_fit(FitRequest(n_ctx=c, flash_attn=True, mmap=False)) for c in CONTEXTS)
    [results] = run_jobs([DryRunJob(skeleton, reqs)], timeout=300)
    measured = {c: sum(b.compute for b in r.buffers) for c, r in zip(CONTEXTS, results)}
    assert {c: _predicted(skeleton, c) for c in CONTEXTS} == measured
