"""StepMasks: a step's grammar masks filled on a worker thread beside the executor's step, or after it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from localinfer.serve import masks as step_masks

pytest.importorskip("llguidance")
pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def tok(default_model):
    from localinfer.backends.vocab import VocabOnly
    from localinfer.generation.constraints import grammar_tokenizer

    v = VocabOnly(str(default_model))
    yield grammar_tokenizer(v)
    v.close()


def _constraints(tok):
    from localinfer.generation.constraints import Constraint, grammar_from

    g = grammar_from("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}}, "schema")
    cs = [Constraint(tok, g) for _ in range(3)]
    for c, text in zip(cs, ('{"n": 1', '{"', '')):
        c.sync(tok.tokenize_str(text))
    return cs


@pytest.mark.parametrize("overlap", [True, False])
def test_masks_are_filled_by_finish_on_the_worker_or_in_finish(tok, monkeypatch, overlap):
    threads = []
    real = step_masks.fill_masks

    def fill(items):
        threads.append(threading.get_ident())
        real(items)

    monkeypatch.setattr(step_masks, "fill_masks", fill)
    cs, alone = _constraints(tok), _constraints(tok)
    m = step_masks.StepMasks(overlap)
    try:
        m.start([(c, list(c.tokens), ()) for c in cs])
        m.finish()
    finally:
        m.close()
    assert (threads[0] != threading.get_ident()) is overlap
    for c, a in zip(cs, alone):
        assert c._filled() is not None                   # filled for this state: apply computes nothing more
        np.testing.assert_array_equal(c.mask(), a.mask())
    assert m.wait_s >= 0


def test_a_failed_fill_is_raised_by_finish_and_the_next_step_starts_clean(tok):
    m = step_masks.StepMasks(True)
    try:
        m.start([(object(), [], ())])
        with pytest.raises(AttributeError):
            m.finish()
        cs = _constraints(tok)
        m.start([(c, list(c.tokens), ()) for c in cs])
        m.finish()
        assert all(c._filled() is not None for c in cs)
    finally:
        m.close()


def test_the_engine_fills_beside_the_forward_pass_only_where_a_core_is_free(default_model):
    """A CPU forward pass whose threads take every core is not given a mask thread beside it; one on fewer
    threads, or on an accelerator (cpu_threads 0), is; an explicit choice stands."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.generation.load import usable_cores
    from localinfer.serve.block_manager import BlockManager
    from localinfer.serve.engine import StepEngine
    from localinfer.serve.scheduler import Scheduler, SchedulerConfig
    from localinfer.serve.simulated import SimulatedExecutor
    from localinfer.serve.step_model import LinearStepModel

    cores = usable_cores()

    def engine(ex, **kw):
        return StepEngine(ex, Scheduler(SchedulerConfig(max_running=2), BlockManager(64, 16, pool_hits=False)), **kw)

    assert step_masks.spare_core(0) and step_masks.spare_core(cores - 1) and not step_masks.spare_core(cores)
    assert engine(SimulatedExecutor(LinearStepModel.parse("26.22,30.4,3"), n_slots=2)).masks.overlap                 # its forward pass takes no core
    for threads in sorted({1, cores}):
        with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=256, threads=threads, n_gpu_layers=0) as ex:
            assert ex.caps.cpu_threads == threads
            assert engine(ex).masks.overlap is (threads < cores)
            assert engine(ex, overlap_masks=True).masks.overlap and not engine(ex, overlap_masks=False).masks.overlap
