"""The paged executor against the static-cache engine: prefill, decode, mixed batches, prefix hits, preemption.

Tolerance.  Paged and static runs compute the same float32 operations but not
always with the same shapes: a batched step multiplies an [N, E] activation
where a lone request multiplies [1, E] (another BLAS kernel, another summation
order), and a request's attention row in a batch also spans the other
requests' keys under the mask (exact zeros that move the reduction's lane
split).  A request alone in the paged executor has the static engine's shapes
and its logits are equal to the bit.  In batches, measured max |Δlogit|
(logits of magnitude ~10-30): ≤ 1.1e-6 on the tiny models, 5.3e-5 on the
embedded 30-layer model, with an f32 KV cache; with f16/bf16/q8_0/q4_0 caches a K or
V value one ulp away can round to the neighbouring cache value (measured up
to 5e-3 by test_torch_engine), 6.7e-6 here.  A wrong position, mask or block
costs whole units, so ATOL_F32 = 2e-4 and ATOL_LOSSY = 2e-2 separate the two
cleanly.  Greedy tokens must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend.engine import TorchEngine
from cuda_backend.paged_executor import PagedExecutor
from localinfer.backends.engine import LoadPlan
from localinfer.errors import ContextFullError
from localinfer.backends.executor import Chunk
from tests.support.ggufgen import write_tiny_llama

torch.set_num_threads(1)
ATOL_F32, ATOL_LOSSY = 2e-4, 2e-2


def static_engine(path, kind="f32", n_ctx=256):
    return TorchEngine(LoadPlan(str(path), n_ctx=n_ctx, n_seq=1, type_k=kind, type_v=kind, device="cpu",
                                n_threads=1, options={"quiet": True}))


def alone(eng, prompt, n_decode):
    """Logits rows (last prompt token, then each greedy decode) of one request in the static engine."""
    eng.trim(0)
    rows = [eng.eval(prompt, logits_at=[len(prompt) - 1])[0]]
    for _ in range(n_decode):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[0])
    return np.stack(rows)


def drive(ex, prompts, n_decode, chunk=None, slots=None):
    """Continuous batching by hand: every step has each decode, then a prompt piece of <= chunk per request."""
    slots = slots or list(range(len(prompts)))
    done = [0] * len(prompts)
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    while any(len(r) < n_decode + 1 for r in rows):
        chunks = []
        for i, p in enumerate(prompts):
            if len(rows[i]) > n_decode:
                continue
            if done[i] >= len(p):
                chunks.append(Chunk(slots[i], (int(np.argmax(rows[i][-1])),), done[i], True))
            else:
                end = len(p) if chunk is None else min(len(p), done[i] + chunk)
                chunks.append(Chunk(slots[i], tuple(p[done[i]:end]), done[i], end == len(p)))
        out = ex.step(chunks)
        for c in chunks:
            i = slots.index(c.slot)
            done[i] = c.start + len(c.tokens)
            if c.logits:
                rows[i].append(out[c.slot])
    return [np.stack(r) for r in rows]


def prompts_for(n_vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, n_vocab, n)] for n in lengths]


def check(paged, ref, atol):
    assert paged.shape == ref.shape
    assert np.abs(paged - ref).max() <= atol, np.abs(paged - ref).max()
    assert (paged.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_prefill_decode_mixed(tiny_models, arch):
    eng = static_engine(tiny_models[arch])
    prompts = prompts_for(eng.n_vocab, [37, 5, 20])
    refs = [alone(eng, p, 6) for p in prompts]
    ex = PagedExecutor(eng.model, n_slots=4, num_blocks=24, type_k="f32", type_v="f32")
    for paged, ref in zip(drive(ex, prompts, 6, chunk=16), refs):   # decodes and prefill pieces in one step
        check(paged, ref, ATOL_F32)
    assert ex.steps == 9 and ex.tokens_computed == sum(map(len, prompts)) + 3 * 6
    ex1 = PagedExecutor(eng.model, n_slots=1, num_blocks=24, type_k="f32", type_v="f32")
    check(drive(ex1, prompts[:1], 6)[0], refs[0], 0.0)      # alone: the static engine's shapes, equal to the bit
    eng.close()


def test_tiny_gguf_and_padded_decode_path(tmp_path):
    """Another shape (head size 16, one KV head, three layers, no tokenizer), and the padded decode step."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3, n_head_kv=1, tokenizer=False,
                            extra_kv={"tokenizer.ggml.model": "none"})
    eng = static_engine(path)
    prompts = prompts_for(eng.n_vocab, [19, 3, 33], seed=1)
    refs = [alone(eng, p, 5) for p in prompts]
    for padded in (False, True):       # True: the CUDA-graph step (3 decodes padded to 4), run eagerly
        ex = PagedExecutor(eng.model, n_slots=4, num_blocks=12, type_k="f32", type_v="f32", padded_decode=padded)
        assert (ex.graphs is not None) == padded
        ex.max_mask_elements = 800 if padded else ex.max_mask_elements   # prefill step split into forwards
        for paged, ref in zip(drive(ex, prompts, 5), refs):
            check(paged, ref, ATOL_F32)
        assert ex.forwards == ex.steps + padded          # the 55-token first step ran as 22 + 33
        assert not padded or (ex.graphs.widths == (2, 4, 8, 16) and ex.graphs.width_for(3) == 4)
    eng.close()


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0", "q4_0"])
def test_lossy_caches_equal_static(tiny_models, kind):
    eng = static_engine(tiny_models["llama"], kind)
    prompts = prompts_for(eng.n_vocab, [40, 9], seed=2)
    refs = [alone(eng, p, 4) for p in prompts]
    ex = PagedExecutor(eng.model, n_slots=2, num_blocks=10, type_k=kind, type_v=kind)
    for paged, ref in zip(drive(ex, prompts, 4, chunk=24), refs):
        check(paged, ref, ATOL_LOSSY)
    eng.close()


@pytest.fixture(scope="module")
def embedded(default_model):
    eng = static_engine(default_model, n_ctx=128)
    yield eng
    eng.close()


def test_embedded_model_batch_equals_alone(embedded):
    prompts = prompts_for(embedded.n_vocab, [30, 7, 18, 1], seed=3)
    refs = [alone(embedded, p, 3) for p in prompts]
    ex = PagedExecutor(embedded.model, n_slots=4, num_blocks=16, type_k="f32", type_v="f32")
    for paged, ref in zip(drive(ex, prompts, 3, chunk=12), refs):
        check(paged, ref, ATOL_F32)
    assert ex.cells_used() == sum(len(p) + 3 for p in prompts)
    for s in range(4):
        ex.drop(s)
    assert ex.cells_used() == 0 and ex.alloc.num_free == 16


def test_prefix_copy_reuses_blocks_and_copies_on_write(tiny_models):
    eng = static_engine(tiny_models["qwen2"])
    base = prompts_for(eng.n_vocab, [40], seed=4)[0]
    a, b, c = base, base[:32] + [7, 8, 9], base[:20] + [11, 12]
    refs = [alone(eng, p, 3) for p in (a, b, c)]
    ex = PagedExecutor(eng.model, n_slots=3, num_blocks=12, type_k="f32", type_v="f32")
    ex.step([Chunk(0, tuple(a), 0, False)])
    used = ex.alloc.num_free
    ex.copy(0, 1, 32)                      # two whole blocks shared
    ex.copy(0, 2, 20)                      # one whole block + a partial one: copied when written
    assert ex.alloc.num_free == used and ex.tables[1] == ex.tables[0][:2] and ex.tables[2] == ex.tables[0][:2]
    computed = ex.tokens_computed
    out = ex.step([Chunk(1, tuple(b[32:]), 32, True), Chunk(2, tuple(c[20:]), 20, True)])
    assert ex.tokens_computed - computed == 3 + 2           # the shared prefix was not recomputed
    assert ex.tables[2][0] == ex.tables[0][0] and ex.tables[2][1] != ex.tables[0][1]   # copy-on-write
    check(out[1][None], refs[1][:1], ATOL_F32)
    check(out[2][None], refs[2][:1], ATOL_F32)
    ex.drop(0)
    ex.drop(1)
    ex.drop(2)
    assert ex.alloc.num_free == 12 and ex.cells_used() == 0
    eng.close()


def test_full_pool_leaves_every_slot_as_it_was(tiny_models):
    eng = static_engine(tiny_models["llama"])
    p = prompts_for(eng.n_vocab, [30, 30], seed=5)
    ex = PagedExecutor(eng.model, n_slots=2, num_blocks=3, type_k="f32", type_v="f32")
    ex.step([Chunk(0, tuple(p[0][:16]), 0, False)])
    with pytest.raises(ContextFullError, match="free blocks"):
        ex.step([Chunk(0, tuple(p[0][16:]), 16, False), Chunk(1, tuple(p[1]), 0, True)])
    assert ex.lens == [16, 0] and ex.tables[1] == [] and len(ex.tables[0]) == 1 and ex.alloc.num_free == 2
    with pytest.raises(ValueError, match="cannot start"):
        ex.step([Chunk(0, (1,), 3)])
    eng.close()
