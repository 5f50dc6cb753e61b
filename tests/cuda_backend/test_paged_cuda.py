"""CUDA only: decode steps replayed from captured graphs equal eager steps, and their memory stays within
``memory.torch_graph_bytes`` (what ``fit --backend torch`` counts).  Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from cuda_backend.memory import torch_graph_bytes
from cuda_backend.serving import open_executor
from localinfer.backends.executor import Chunk
from tests.cuda_backend.test_paged_executor import prompts_for

MIB = 1 << 20


def _decode(ex, prompts, n):
    out = ex.step([Chunk(i, tuple(p), 0, True) for i, p in enumerate(prompts)])
    rows = [[out[i]] for i in range(len(prompts))]
    for _ in range(n):
        chunks = [Chunk(i, (int(np.argmax(rows[i][-1])),), len(p) + len(rows[i]) - 1, True)
                  for i, p in enumerate(prompts)]
        out = ex.step(chunks)
        for i in range(len(prompts)):
            rows[i].append(out[i])
    return np.stack([np.stack(r) for r in rows])


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_replay_equals_eager(default_model, batch):
    kw = {"n_slots": 8, "n_ctx": 256, "device": "cuda", "dtype": "bf16", "external_blocks": False}   # by hand
    with open_executor(default_model, cuda_graphs=False, **kw) as eager, open_executor(default_model, **kw) as g:
        assert eager.graphs is None and sorted({b for b, _ in g.graphs.graphs}) == [1, 2, 4, 8]
        prompts = prompts_for(eager.n_vocab, [20 + 3 * i for i in range(batch)])
        a, b = _decode(eager, prompts, 4), _decode(g, prompts, 4)
        assert np.abs(a - b).max() <= 0.1 * np.abs(a).max()    # bf16: another attention shape, same tokens
        assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9


def test_graph_memory_within_fit_estimate(default_model):
    with open_executor(default_model, n_slots=16, n_ctx=2048, device="cuda", dtype="bf16") as ex:
        estimate = torch_graph_bytes(ex.spec, 2048, 16, "bf16")
        used = ex.graphs.measured_bytes
        print(f"graph memory: measured {used / MIB:.1f} MiB, estimate {estimate / MIB:.1f} MiB")
        assert len(ex.graphs.graphs) == 5 * len(ex.graphs.widths) == 5 * 4
        assert used <= estimate + 16 * MIB       # the caching allocator reserves 2 MiB segments
