"""The step engine on the real llama.cpp executor (embedded model): prefix hits are copies, cells = blocks."""

import pytest

from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Scheduler, SchedulerConfig

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def executor(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=3, n_ctx=768, threads=1, flash_attn=True) as ex:
        yield ex


def _engine(ex, **cfg):
    for slot in range(ex.n_slots):
        ex.drop(slot)
    config = SchedulerConfig(max_running=3, policy="chunked", chunk_tokens=16, **cfg)
    return StepEngine(ex, Scheduler(config, BlockManager(40, 16, pool_hits=False)))


def test_prefix_hit_copies_cells_and_counts_match(executor):
    tok = executor.engine.tokenize
    system = tuple(tok("You are a helpful assistant. Answer briefly and clearly, please. " * 3))[:32]
    e = _engine(executor)
    a = e.add_request(Request("a", system + tuple(tok(" The capital of France is")), 6))
    for _ in range(3):
        e.step()
    b = e.add_request(Request("b", system + tuple(tok(" The capital of Spain is")), 6))
    c = e.add_request(Request("c", tuple(tok("Water boils at")), 6))
    while e.unfinished:
        e.step()
        assert executor.cells_used() == e.blocks.tokens_in_use()
    assert b.cached == 32 and executor.cells_used() == 0 and e.blocks.used == 0
    assert all(r.finish_reason is FinishReason.LENGTH for r in (a, b, c))
