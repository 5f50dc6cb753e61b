"""One source of blocks: the torch serving executor (as ``serving.open_executor`` builds it) reads and writes
exactly the blocks the serving engine's block manager gives each request, through prefix hits (from the pool
and from a running request), copy-on-write, preemption and recompute; a table that disagrees is refused.
The CUDA-graph decode step stages its inputs once (one host-to-device copy per step), checked on the CPU
through the same padded path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

from cuda_backend.memory import graph_batches
from cuda_backend.paged_executor import PagedExecutor
from cuda_backend.serving import BLOCK_TOKENS, open_executor
from localinfer.backends.executor import Chunk
from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.request import Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from tests.cuda_backend.test_paged_executor import ATOL_F32, alone, check, drive, prompts_for, static_engine

torch.set_num_threads(1)


def open_tiny(path, n_blocks, n_slots=3, **kw):
    return open_executor(path, n_slots=n_slots, n_ctx=96, device="cpu", threads=1, type_k="f32", type_v="f32",
                         num_blocks=n_blocks, **kw)


def check_tables(e, ex) -> None:
    """Every seated request's executor table is its block manager table; free slots hold nothing."""
    seated = set(e.slot_of.values())
    for r in e.scheduler.running:
        assert ex.tables[e.slot_of[r.id]] == e.blocks.tables[r.id], r.id
    for s in range(ex.n_slots):
        if s not in seated:
            assert ex.tables[s] == [] and ex.lens[s] == 0
    assert ex.cells_used() == e.blocks.tokens_in_use()


def run(e, ex) -> None:
    while e.unfinished:
        e.step()
        check_tables(e, ex)


def test_block_size_is_the_block_managers(tiny_models):
    from cuda_backend.memory import TORCH_BLOCK_TOKENS

    assert BLOCK_TOKENS == DEFAULT_BLOCK_TOKENS == TORCH_BLOCK_TOKENS   # fit counts the pool in the same blocks
    with open_tiny(tiny_models["qwen3"], 8) as ex:
        assert ex.external and ex.restores_cached_prefix and ex.block_size == BLOCK_TOKENS
        with pytest.raises(ValueError, match="one block size"):
            StepEngine(ex, Scheduler(SchedulerConfig(max_running=3), BlockManager(16, 8, pool_hits=False)))


@pytest.mark.parametrize("pool_hits", [True, False], ids=["pool-hits", "live-hits"])
def test_tables_equal_the_block_managers(tiny_models, pool_hits):
    """add / step / prefix hit / copy-on-write / preempt + recompute: after every step the executor's tables
    are the block manager's, and every reply equals its request run alone in a large pool."""
    path = tiny_models["qwen3"]
    eng = static_engine(path)
    n_vocab = eng.n_vocab
    shared = prompts_for(n_vocab, [40], seed=21)[0]
    prompts = [shared + [3, 4], shared[:32] + [5] * 7, shared + [6], prompts_for(n_vocab, [30], seed=22)[0]]
    want = [[int(np.argmax(r)) for r in alone(eng, p, 11)] for p in prompts]
    eng.close()
    for n_blocks, admission in ((40, "reserve"), (5, "on_demand")):
        with open_tiny(path, n_blocks) as ex:
            bm = BlockManager(ex.pool.num_blocks, ex.block_size, pool_hits=pool_hits)
            e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=3, admission=admission, policy="chunked",
                                                     chunk_tokens=16), bm))
            first = e.add_request(Request("r0", tuple(prompts[0]), 12))
            e.step()
            check_tables(e, ex)
            if not pool_hits:            # a hit is a copy from r0 while it runs
                while first.computed < len(prompts[0]):
                    e.step()
                    check_tables(e, ex)
            else:                        # r0 finishes; its whole blocks stay cached in the pool
                run(e, ex)
            reqs = [first] + [e.add_request(Request(f"r{i}", tuple(p), 12)) for i, p in enumerate(prompts[1:], 1)]
            run(e, ex)
            assert [r.output for r in reqs] == want
            if admission == "reserve":       # both hits read, not recomputed
                assert reqs[1].cached == reqs[2].cached == 32
            else:                            # preempted and back; from the pool, its own blocks are read again
                assert sum(r.preemptions for r in reqs) > 0
                assert not pool_hits or any(r.preemptions and r.cached > 32 for r in reqs)
            assert ex.cells_used() == 0 and all(not t for t in ex.tables)


def test_a_table_that_disagrees_is_refused(tiny_models):
    with open_tiny(tiny_models["qwen3"], 8) as ex:
        with pytest.raises(ValueError, match=r"1 blocks of 16 tokens \(16 positions\).*positions 0\.\.19"):
            ex.step([Chunk(0, tuple(range(1, 21)), 0, True, blocks=(3,))])
        with pytest.raises(ValueError, match="0 blocks of 16 tokens"):
            ex.step([Chunk(0, (1, 2), 0, True)])            # no table at all
        with pytest.raises(ValueError, match="outside the pool's 8 blocks"):
            ex.step([Chunk(0, (1, 2), 0, True, blocks=(8,))])
        assert ex.steps == 0 and ex.cells_used() == 0 and all(not t for t in ex.tables)
        out = ex.step([Chunk(0, (1, 2), 0, True, blocks=(5,))])
        assert 0 in out and ex.tables[0] == [5]


def test_padded_decode_copies_inputs_once(tiny_models):
    """The CUDA-graph decode path (run eagerly off CUDA): one staged host-to-device copy per decode step, tables
    cut to the blocks a step reads, and the same logits as the static engine."""
    eng = static_engine(tiny_models["llama"])
    prompts = prompts_for(eng.n_vocab, [21, 5, 40], seed=23)
    refs = [alone(eng, p, 4) for p in prompts]
    ex = PagedExecutor(eng.model, n_slots=4, num_blocks=16, type_k="f32", type_v="f32", padded_decode=True,
                       max_model_len=96)
    for paged, ref in zip(drive(ex, prompts, 4), refs):      # 3 decodes a step: padded to the batch-4 graph
        check(paged, ref, ATOL_F32)
    g = ex.graphs
    assert g.batches == graph_batches(4) == (1, 2, 4)
    assert g.host_copies == 4 and ex.steps == 5             # the prompt step is varlen; 4 decode steps staged
    assert g.inputs.shape == (4, 3 + ex.max_blocks) and g.tokens.data_ptr() == g.inputs.data_ptr()
    b, w = g.load([7], [20], [ex.pool.scratch_slot - 1], [[1, 2]])     # one request: padded to 1 row, width 2
    assert (b, w) == (1, 2) and g.inputs[0, :5].tolist() == [7, 20, ex.pool.scratch_slot - 1, 1, 2]
    b, w = g.load([1, 2, 3], [0, 1, 2], [0, 1, 2], [[4], [5], [6]])
    assert (b, w) == (4, 1) and g.inputs[3, :4].tolist() == [0, 0, ex.pool.scratch_slot, 0]   # the padded row
    with pytest.raises(ValueError, match="exceeds the 6 a slot can hold"):
        g.load([1], [0], [0], [list(range(7))])
    eng.close()


def test_the_executor_captures_the_batches_fit_counts(tiny_models):
    """A 64-slot executor pads decode steps up to a batch-64 graph, the batch sizes fit's graph memory counts."""
    eng = static_engine(tiny_models["llama"])
    ex = PagedExecutor(eng.model, n_slots=64, num_blocks=8, type_k="f32", type_v="f32", padded_decode=True,
                       max_model_len=64)
    assert ex.graphs.batches == graph_batches(64) == (1, 2, 4, 8, 16, 32, 64)
    assert ex.graphs.batch_for(33) == 64 and ex.graphs.inputs.shape[0] == 64
    eng.close()
