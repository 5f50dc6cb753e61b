"""The paged KV pool: bytes equal fit's for the same plan, reads equal the static cache's, graph memory counted."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from cuda_backend.kv_cache import KVCache
from cuda_backend.memory import (
    CUDA_GRAPH_MAX_BATCH,
    MEMORY,
    graph_batches,
    graph_widths,
    torch_block_bytes,
    torch_budget_blocks,
    torch_graph_bytes,
    torch_kv_bytes,
    torch_pool_blocks,
)
from cuda_backend.paged_kv import BlockAllocator, PagedKVPool, token_slots
from localinfer.backends.memory import FitRequest
from localinfer.model.spec import ModelSpec
from localinfer.plan.memory import kv_bytes

torch.set_num_threads(1)


def _pool(spec, blocks, type_k="f16", type_v="f16", **kw):
    return PagedKVPool(spec.n_layers, blocks, 16, spec.n_head_kv[0], spec.head_dim_k, type_k, type_v, **kw)


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("bf16", "q4_0"),
                                           ("f32", "f32")])
@pytest.mark.parametrize("n_ctx,n_seq", [(1, 1), (100, 1), (512, 3)])
def test_pool_bytes_equal_fit(tiny_models, type_k, type_v, n_ctx, n_seq):
    spec = ModelSpec.from_gguf(tiny_models["llama"])
    blocks = torch_pool_blocks(n_ctx, n_seq)
    pool = _pool(spec, blocks, type_k, type_v)
    assert pool.nbytes == blocks * torch_block_bytes(spec, type_k, type_v)
    assert pool.nbytes == kv_bytes(spec, n_ctx, type_k, type_v, backend="torch", n_seq=n_seq)
    assert pool.nbytes == torch_kv_bytes(spec, n_ctx, type_k, type_v, n_seq=n_seq)
    assert pool.block_nbytes(spec.n_layers, 16, spec.n_head_kv[0], spec.head_dim_k, type_k, type_v) \
        == torch_block_bytes(spec, type_k, type_v)
    with_scratch = _pool(spec, blocks, type_k, type_v, scratch=True)
    assert with_scratch.nbytes - pool.nbytes == torch_block_bytes(spec, type_k, type_v)
    assert torch_budget_blocks(spec, pool.nbytes + 1, type_k, type_v) == blocks


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_reads_equal_the_static_cache(kind):
    """The same K/V written by position (static) and through a slot mapping (paged) read back identically."""
    n_layers, n_kv, d, n = 2, 2, 64, 37
    static = KVCache(n_layers, 1, 64, n_kv, d, kind, kind)
    pool = PagedKVPool(n_layers, 8, 16, n_kv, d, kind, kind)
    table = [5, 0, 3]
    k, v = torch.randn(1, n, n_kv, d), torch.randn(1, n, n_kv, d)
    slots = torch.tensor(token_slots(table, 0, n, 16))
    for il in range(n_layers):
        static.write(il, torch.tensor([[0]]), torch.arange(n)[None], k, v)
        pool.write(il, slots, k[0], v[0])
        sk, sv = static.read(il, None, 1, n)
        pk, pv = pool.read_slots(il, slots)
        assert torch.equal(sk, pk) and torch.equal(sv, pv)
        tk, tv = pool.read_tables(il, torch.tensor([table]))
        assert tk.shape == (1, n_kv, 48, d) and torch.equal(tk[:, :, :n], sk) and torch.equal(tv[:, :, :n], sv)
    pool.copy_block(0, 7, 5)
    assert torch.equal(pool.k[0][7, :5], pool.k[0][0, :5]) and not pool.k[0][7, 5:].any()


def test_allocator_counts_references():
    a = BlockAllocator(3)
    b0, b1 = a.take(), a.take()
    a.ref(b0)
    a.unref(b0)
    assert a.num_free == 1 and a.refs[b0] == 1
    a.unref(b0)
    a.unref(b1)
    assert a.num_free == 3


def test_graph_batches_reach_the_slots():
    """Powers of two below the slots, then the slot count (a step never holds more decodes), capped at 512."""
    assert graph_batches(1) == (1,) and graph_batches(2) == (1, 2)
    assert graph_batches(5) == (1, 2, 4, 5)
    assert graph_batches(32) == (1, 2, 4, 8, 16, 32)
    assert graph_batches(64) == (1, 2, 4, 8, 16, 32, 64)      # a 64-slot engine gets its batch-64 graph
    assert graph_batches(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert graph_batches(10_000)[-1] == CUDA_GRAPH_MAX_BATCH == 512
    assert graph_widths(16) == (2, 4, 8, 16) and graph_widths(5) == (1, 2, 3, 5) and graph_widths(1) == (1,)


def test_fit_counts_cuda_graphs_on_cuda_only(default_model):
    from localinfer.devices.profiles import get_device

    spec = ModelSpec.from_gguf(default_model)
    req = FitRequest(n_ctx=4096, n_seq=8, backend="torch")
    gpu = get_device("h200")
    bd, _ = MEMORY.breakdown(spec, gpu, req)
    graphs = [t for t in bd.terms if t.key == "compute"]
    assert len(graphs) == 1 and graphs[0].bytes == torch_graph_bytes(spec, 4096, 8, "bf16") > 0
    assert "1/2/4/8" in graphs[0].label
    assert bd.kv == torch_pool_blocks(4096, 8) * torch_block_bytes(spec)
    more = torch_graph_bytes(spec, 8192, 32, "bf16")
    assert more > graphs[0].bytes
    wide, _ = MEMORY.breakdown(spec, gpu, replace(req, n_seq=64))    # fit counts the batch-64 graph it captures
    term = next(t for t in wide.terms if t.key == "compute")
    assert term.label.endswith("batch 1/2/4/8/16/32/64)") and term.bytes == torch_graph_bytes(spec, 4096, 64, "bf16")
    assert term.bytes > torch_graph_bytes(spec, 4096, 32, "bf16")
    on_cpu, _ = MEMORY.breakdown(spec, replace(gpu, kind="cpu"), req)
    assert on_cpu.compute == 0 and on_cpu.kv == bd.kv  # no graphs without CUDA
    shared = replace(req, n_ctx=1024, n_seq=4, n_ctx_total=4096)   # run/serve: 4 sequences share 4096 positions
    bd, _ = MEMORY.breakdown(spec, gpu, shared)      # one may hold them all (serving.open_plan): graphs attend 4096
    assert bd.compute == torch_graph_bytes(spec, 4096, 4, "bf16") and bd.kv == torch_pool_blocks(1024, 4) * \
        torch_block_bytes(spec)


def test_pool_from_memory_left_after_weights(tiny_models, monkeypatch):
    """With gpu_memory_utilization on CUDA: ⌊(free × utilization − graph bytes) / block bytes⌋ (free is read
    after the weights are loaded); elsewhere the plan's n_slots × ⌈n_ctx / 16⌉ blocks."""
    from cuda_backend.serving import pool_blocks

    spec = ModelSpec.from_gguf(tiny_models["llama"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 20 << 30))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    got = pool_blocks(spec, 1024, 8, "f16", "q8_0", cuda, torch.bfloat16, 0.5)
    want = ((5 << 30) - torch_graph_bytes(spec, 1024, 8, "bf16", "f16", "q8_0")) // torch_block_bytes(spec, "f16", "q8_0")
    assert got == want > 0
    assert pool_blocks(spec, 1024, 8, "f16", "q8_0", cpu, torch.float32, 0.5) == torch_pool_blocks(1024, 8) == 512
    assert pool_blocks(spec, 1024, 8, "f16", "q8_0", cuda, torch.bfloat16) == 512
