"""The llama.cpp executor on the embedded model, 1 thread, flash attention on.

Logits are compared bit for bit (``np.array_equal``), not by argmax: llama.cpp's
CPU kernels compute a row the same whatever else is in the batch as long as the
row takes the same attention kernel (the tests keep every ubatch under 64 rows:
ggml's one-row flash-attention kernel) over the same cells in the same order
(a fresh cache fills in position order; the per-slot-stream tests refill a
freed slot), so anything short of equality is a bug in how the executor builds
the batch.  Where equality ends is measured in benchmarks/serving.py and told
in the executor's docstring.
"""

from __future__ import annotations

import numpy as np
import pytest

from localinfer.errors import ContextFullError
from localinfer.backends.executor import Chunk, Executor

pytest.importorskip("llama_cpp")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Once upon a time, in a small village,"]
N_DECODE = 6


@pytest.fixture(scope="module")
def executor(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=4, n_ctx=512, threads=1, flash_attn=True) as ex:
        yield ex


@pytest.fixture
def ex(executor):
    for s in range(executor.n_slots):
        executor.drop(s)
    assert executor.cells_used() == 0
    return executor


def _tokens(ex, text):
    return tuple(ex.engine.tokenize(text, add_bos=True))


def _alone(ex, tokens, forced, slot=0):
    """Logits of a prompt then each forced token, one chunk per step and nothing else in the batch."""
    rows = [ex.step([Chunk(slot, tokens, 0, True)])[slot]]
    pos = len(tokens)
    for t in forced:
        rows.append(ex.step([Chunk(slot, (t,), pos, True)])[slot])
        pos += 1
    ex.drop(slot)
    return rows


def test_is_an_executor(ex):
    assert isinstance(ex, Executor)
    assert ex.n_slots == 4 and ex.n_cells == 512 and ex.n_vocab == ex.engine.n_vocab


def test_a_batch_of_slots_gives_the_logits_each_slot_gives_alone(ex):
    prompts = [_tokens(ex, p) for p in PROMPTS]
    # step 0: slots 0 and 1 prefill; then they decode while slot 2's prompt joins at step 2 (mixed batch)
    rows: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    out = ex.step([Chunk(0, prompts[0], 0, True), Chunk(1, prompts[1], 0, True)])
    for s in (0, 1):
        rows[s].append(out[s])
    for step in range(1, N_DECODE + 3):
        chunks = [Chunk(s, (int(np.argmax(rows[s][-1])),), len(prompts[s]) + len(rows[s]) - 1, True)
                  for s in (0, 1) if len(rows[s]) <= N_DECODE]
        if step == 2:
            chunks.insert(1, Chunk(2, prompts[2], 0, True))
        elif rows[2] and len(rows[2]) <= N_DECODE:
            chunks.append(Chunk(2, (int(np.argmax(rows[2][-1])),), len(prompts[2]) + len(rows[2]) - 1, True))
        if not chunks:
            break
        out = ex.step(chunks)
        assert set(out) == {c.slot for c in chunks}
        for s, r in out.items():
            rows[s].append(r)
    assert ex.cells_used() == sum(len(p) + N_DECODE for p in prompts)
    for s in (0, 1, 2):
        ex.drop(s)
    for s, p in enumerate(prompts):
        forced = [int(np.argmax(r)) for r in rows[s][:-1]]
        alone = _alone(ex, p, forced, slot=3)
        assert len(alone) == len(rows[s]) == N_DECODE + 1
        for k, (a, b) in enumerate(zip(alone, rows[s])):
            assert np.array_equal(a, b), f"slot {s} row {k}: max |diff| {np.abs(a - b).max()}"


def test_rows_without_logits_return_nothing_and_cost_no_output(ex):
    p = _tokens(ex, PROMPTS[0])
    assert ex.step([Chunk(0, p[:3], 0, False), Chunk(1, p, 0, True)]).keys() == {1}
    assert ex.step([Chunk(0, p[3:], 3, False)]) == {}
    assert ex.slot_len(0) == len(p) and ex.slot_len(1) == len(p)


def test_a_copied_prefix_then_continued_equals_a_cold_run(ex):
    prefix = _tokens(ex, "You are a helpful assistant. Answer briefly.\n")
    a = tuple(ex.engine.tokenize("Question: what is two plus two?"))
    b = tuple(ex.engine.tokenize("Question: name a colour."))
    ex.step([Chunk(0, prefix + a, 0, True)])
    before = ex.cells_used()
    ex.copy(0, 1, len(prefix))
    assert ex.cells_used() == before                      # sharing adds a sequence id, not cells
    assert ex.slot_len(1) == len(prefix)
    cells = ex.cells()
    assert sum(1 for _, seqs in cells if seqs == (0, 1)) == len(prefix)
    warm = [ex.step([Chunk(1, b, len(prefix), True)])[1]]
    for i in range(N_DECODE):
        warm.append(ex.step([Chunk(1, (int(np.argmax(warm[-1])),), len(prefix) + len(b) + i, True)])[1])
    assert ex.cells_used() == len(prefix) + len(a) + len(b) + N_DECODE
    ex.drop(0)
    assert ex.cells_used() == len(prefix) + len(b) + N_DECODE     # the shared cells stay for slot 1
    ex.drop(1)
    cold = _alone(ex, prefix + b, [int(np.argmax(r)) for r in warm[:-1]], slot=2)
    for k, (c, w) in enumerate(zip(cold, warm)):
        assert np.array_equal(c, w), f"row {k}: max |diff| {np.abs(c - w).max()}"


def test_drop_frees_cells_and_a_partial_drop_rewinds(ex):
    p = _tokens(ex, PROMPTS[1])
    ex.step([Chunk(0, p, 0, False), Chunk(1, p[:4], 0, False)])
    assert ex.cells_used() == len(p) + 4
    ex.drop(0, start=5)
    assert ex.cells_used() == 9 and ex.slot_len(0) == 5
    ex.copy(1, 2, 4)
    ex.drop(1)
    assert ex.cells_used() == 9                           # slot 2 still holds slot 1's four cells
    ex.drop(2)
    ex.drop(0)
    assert ex.cells_used() == 0 and ex.cells() == []
    assert all(ex.slot_len(s) == 0 for s in range(ex.n_slots))


def test_out_of_kv_is_a_typed_error_and_the_step_is_undone(ex):
    filler = tuple(range(1000, 1400))                     # 400 of the 512 cells
    ex.step([Chunk(0, filler, 0, False)])
    with pytest.raises(ContextFullError) as info:
        ex.step([Chunk(0, (5,), 400, True), Chunk(1, tuple(range(2000, 2120)), 0, True)])
    assert info.value.needed == 121 and info.value.available == 112
    assert ex.cells_used() == 400 and ex.slot_len(0) == 400 and ex.slot_len(1) == 0
    out = ex.step([Chunk(0, (5,), 400, True), Chunk(1, tuple(range(2000, 2100)), 0, True)])  # 101 still fit
    assert set(out) == {0, 1} and ex.cells_used() == 501
    with pytest.raises(ContextFullError):
        ex.step([Chunk(3, tuple(range(600)), 0, False)])  # one request longer than the whole cache


def test_a_step_split_over_several_decodes_is_undone_whole(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=256, threads=1, n_batch=64, n_ubatch=64) as ex:
        ex.step([Chunk(0, tuple(range(100, 260)), 0, False)])           # three decodes of <= 64 rows
        assert ex.cells_used() == 160
        with pytest.raises(ContextFullError):
            ex.step([Chunk(0, tuple(range(300, 340)), 160, False), Chunk(1, tuple(range(400, 480)), 0, True)])
        assert ex.cells_used() == 160 and ex.slot_len(0) == 160 and ex.slot_len(1) == 0


def test_several_logit_rows_of_one_chunk_equal_the_rows_of_one_token_steps(ex):
    """A speculative step verifies pending + drafts in one chunk with ``n_logits`` rows: each row is what
    decoding that token alone gives (fewer than 64 rows: the same attention kernel)."""
    p, forced = _tokens(ex, PROMPTS[1]), (1, 42, 7)
    alone = _alone(ex, p, forced)
    rows = ex.step([Chunk(0, p + forced, 0, True, n_logits=len(forced) + 1)])[0]
    assert rows.shape == (len(forced) + 1, ex.n_vocab)
    assert all(np.array_equal(rows[i], alone[i]) for i in range(len(forced) + 1))
    ex.drop(0)
    one = ex.step([Chunk(0, p, 0, True, n_logits=1)])[0]
    assert one.shape == (ex.n_vocab,) and np.array_equal(one, alone[0])


def test_lent_rows_are_llama_cpps_own_buffer_read_only_and_equal_to_copies(ex):
    """``lend_rows`` (the serving executor's): a one-row chunk's logits are a read-only view of llama.cpp's output
    buffer, no copy, equal bit for bit to the copied row; the next step rewrites it, which is why only a caller that
    reads every row before its next call (the serving engine) asks for them.  A several-row chunk is still stacked."""
    p, forced = _tokens(ex, PROMPTS[0]), (5, 9)
    alone = _alone(ex, p, forced)
    ex.lend_rows = True
    try:
        lent = ex.step([Chunk(0, p, 0, True)])[0]
        assert not lent.flags.writeable and not lent.flags.owndata and np.array_equal(lent, alone[0])
        with pytest.raises(ValueError):
            lent[0] = 0.0
        seen = lent.copy()
        nxt = ex.step([Chunk(0, forced[:1], len(p), True)])[0]
        assert np.array_equal(nxt, alone[1]) and np.array_equal(lent, nxt) and not np.array_equal(lent, seen)
        ex.drop(0)
        rows = ex.step([Chunk(0, p + forced, 0, True, n_logits=3)])[0]
        assert rows.flags.owndata and all(np.array_equal(rows[i], alone[i]) for i in range(3))
    finally:
        ex.lend_rows = False
        ex.drop(0)


def test_a_step_split_by_its_outputs_lends_only_its_last_calls_rows(ex):
    """Past ``n_outputs_max`` rows a step takes several llama_decode calls, each writing its outputs from the start of
    llama.cpp's buffer: the earlier calls' rows are copies, only the last call's are lent, and all equal a step
    that lends nothing."""
    prompts = [_tokens(ex, p) for p in PROMPTS]
    for s, p in enumerate(prompts):
        ex.step([Chunk(s, p, 0)])
    step = [Chunk(s, (11,), len(p), True) for s, p in enumerate(prompts)]
    want = {s: r.copy() for s, r in ex.step(step).items()}
    for s, p in enumerate(prompts):
        ex.drop(s, len(p))
    cap, ex.lend_rows, ex.n_outputs_max = ex.n_outputs_max, True, 2
    try:
        got = ex.step(step)
    finally:
        ex.lend_rows, ex.n_outputs_max = False, cap
    assert [got[s].flags.writeable for s in range(3)] == [True, True, False]
    assert all(np.array_equal(got[s], want[s]) for s in range(3))


def test_bad_chunks_are_refused_before_llama_cpp_sees_them(ex):
    with pytest.raises(ValueError, match="cannot start"):
        ex.step([Chunk(0, (1, 2), 3)])
    with pytest.raises(ValueError, match="twice"):
        ex.step([Chunk(0, (1,), 0), Chunk(0, (2,), 1)])
    with pytest.raises(ValueError, match="outside"):
        ex.step([Chunk(9, (1,), 0)])
    with pytest.raises(ValueError, match="token ids"):
        ex.step([Chunk(0, (ex.n_vocab,), 0)])
    for n in (0, 3):
        with pytest.raises(ValueError, match="n_logits"):
            ex.step([Chunk(0, (1, 2), 0, True, n_logits=n)])
    with pytest.raises(ValueError, match="holds 0"):
        ex.copy(0, 1, 3)
    assert ex.cells_used() == 0


# ---- per-slot KV streams (unified=False) ------------------------------------------------------------

@pytest.fixture(scope="module")
def streams(default_model):
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=512, threads=1, unified=False) as ex:
        yield ex


def test_per_slot_streams_store_a_copied_prefix_twice_and_count_it(streams):
    ex = streams
    assert ex.slot_cells == 256 and ex.n_cells == 512
    p = _tokens(ex, PROMPTS[2])
    ex.step([Chunk(0, p, 0, False)])
    ex.copy(0, 1, 5)
    assert ex.cells_used() == len(p) + 5 and ex.slot_len(1) == 5
    assert sorted(pos for pos, seqs in ex.cells() if seqs == (1,)) == [0, 1, 2, 3, 4]
    with pytest.raises(ContextFullError):
        ex.step([Chunk(1, tuple(range(300, 560)), 5, False)])        # past slot 1's own 256 cells
    assert ex.slot_len(1) == 5
    ex.drop(0)
    ex.drop(1)
    assert ex.cells_used() == 0


def test_refilling_a_freed_slot_keeps_per_slot_streams_batch_invariant(streams):
    """The case that breaks a unified cache: a request ends, its cells free up, the others keep decoding
    and a new request takes the slot.  With a stream per slot every row still equals its solo run."""
    ex = streams
    a, b, c = (_tokens(ex, t) for t in PROMPTS)
    rows: dict[str, list] = {"a": [], "b": [], "c": []}
    out = ex.step([Chunk(0, a, 0, True), Chunk(1, b, 0, True)])
    rows["a"].append(out[0])
    rows["b"].append(out[1])
    for i in range(3):                                               # a and b decode 3 tokens
        out = ex.step([Chunk(0, (int(np.argmax(rows["a"][-1])),), len(a) + i, True),
                       Chunk(1, (int(np.argmax(rows["b"][-1])),), len(b) + i, True)])
        rows["a"].append(out[0])
        rows["b"].append(out[1])
    ex.drop(0)                                                       # a ends; c takes its slot
    out = ex.step([Chunk(1, (int(np.argmax(rows["b"][-1])),), len(b) + 3, True), Chunk(0, c, 0, True)])
    rows["b"].append(out[1])
    rows["c"].append(out[0])
    for i in range(3):
        out = ex.step([Chunk(1, (int(np.argmax(rows["b"][-1])),), len(b) + 4 + i, True),
                       Chunk(0, (int(np.argmax(rows["c"][-1])),), len(c) + i, True)])
        rows["b"].append(out[1])
        rows["c"].append(out[0])
    ex.drop(0)
    ex.drop(1)
    for name, p in zip("abc", (a, b, c)):
        alone = _alone(ex, p, [int(np.argmax(r)) for r in rows[name][:-1]], slot=1)
        assert all(np.array_equal(x, y) for x, y in zip(alone, rows[name], strict=True)), name


@pytest.mark.parametrize("lend", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_a_decode_beside_a_long_prefill_is_its_own_call(ex, split, lend):
    """Short chunks beside one of 64+ tokens go in a llama_decode of their own (the one-row attention kernel, as
    in a decode-only step): the decode row's logits equal a decode-only step's bit for bit.  Inside the prefill's
    tiled ubatch (split off) they need not, and the step costs more (benchmarks/results/serve_split_cpu.txt).
    With ``lend_rows`` the first call's row is copied, not lent: the second call writes its own rows over it."""
    assert ex.split_short      # CPU, flash attention on
    a = _tokens(ex, PROMPTS[0])
    long = _tokens(ex, " ".join(["a quick brown fox jumps over the lazy dog"] * 12))
    assert len(long) >= 64
    ex.step([Chunk(0, a, 0)])
    alone = ex.step([Chunk(0, (42,), len(a), True)])[0]
    ex.drop(0, len(a))
    last = _alone(ex, long, (), slot=1)[0]
    calls = []
    decode = ex._decode
    ex._decode = lambda rows, **kw: calls.append(len(rows)) or decode(rows, **kw)
    ex.split_short, ex.lend_rows = split, lend
    try:
        got = ex.step([Chunk(0, (42,), len(a), True), Chunk(1, long, 0, True)])
    finally:
        ex.split_short, ex.lend_rows = True, False
        del ex._decode
    assert got[1].flags.writeable is not lend and int(np.argmax(got[1])) == int(np.argmax(last))
    if split:
        assert calls == [1, len(long)]
        assert got[0].flags.writeable and np.array_equal(got[0], alone)
    else:
        assert calls == [1 + len(long)]


def test_more_sequences_than_logit_rows_decode(default_model, tmp_path):
    """llama.cpp reserves an output row per sequence and aborts (GGML_ASSERT) when they exceed n_outputs_max,
    which the executor capped at 64 and n_batch: 70 sequence ids (``serve --parallel 8 --parked 62``) must decode.
    In a child process, as a regression would abort the interpreter."""
    import subprocess
    import sys

    code = f"""
from localinfer.backends.llamacpp.executor import LlamaCppExecutor
from localinfer.backends.executor import Chunk
with LlamaCppExecutor.open({str(default_model)!r}, n_slots=70, n_ctx=512, n_batch=32, threads=1) as ex:
    assert ex.n_outputs_max >= 70, ex.n_outputs_max
    rows = ex.step([Chunk(s, (1, 2), 0, True) for s in range(0, 70, 10)])
    print(sorted(rows))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-600:]
    assert r.stdout.strip() == str(list(range(0, 70, 10)))


def _interrupt_once_in_flight(ex):
    """A thread that interrupts ``ex`` once a step is inside it (it polls the executor's own flag)."""
    import threading
    import time

    def run():
        deadline = time.monotonic() + 30
        while not ex._stepping and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.01)                       # inside llama_decode by now: a 400-row graph takes far longer
        ex.interrupt()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_an_interrupt_stops_the_graph_in_flight_and_undoes_the_step(ex):
    """interrupt() from another thread: llama.cpp's abort callback stops the graph between nodes (status 2, counted
    in ``aborted``), the step raises StepInterrupted, and every slot holds what it held before it -- the steps after
    it compute, bit for bit, what they compute when it never ran.  A call between steps is forgotten."""
    from localinfer.backends.executor import StepInterrupted

    assert ex.caps.interrupts_steps
    a = _tokens(ex, PROMPTS[0])

    def steps(interrupted: bool):
        ex.step([Chunk(0, tuple(range(1000, 1100)), 0, False)])
        if interrupted:
            aborted = ex.engine.aborted
            t = _interrupt_once_in_flight(ex)
            with pytest.raises(StepInterrupted):
                ex.step([Chunk(0, tuple(range(2000, 2300)), 100, False), Chunk(1, a, 0, True)])
            t.join(30)
            assert ex.engine.aborted == aborted + 1
            assert ex.cells_used() == 100 and ex.slot_len(0) == 100 and ex.slot_len(1) == 0
            ex.interrupt()                     # no step in flight: it would stop the next one as it starts ...
            with pytest.raises(StepInterrupted):
                ex.step([Chunk(0, (5,), 100, True)])
            assert ex.slot_len(0) == 100
            ex.interrupt()
            ex.forget_interrupt()              # ... unless forgotten, as the engine does between steps
        rows = ex.step([Chunk(0, (7,), 100, True), Chunk(1, a, 0, True)])
        rows = [rows[0], rows[1], ex.step([Chunk(1, (42,), len(a), True)])[1]]
        assert ex.slot_len(0) == 101 and ex.slot_len(1) == len(a) + 1 and not ex.engine.interrupted
        for s in range(ex.n_slots):
            ex.drop(s)
        return rows

    cold = steps(interrupted=False)
    assert all(np.array_equal(x, y) for x, y in zip(steps(interrupted=True), cold, strict=True))


def test_an_interrupt_between_the_decodes_of_a_step_stops_before_the_next(default_model):
    """Where no graph is stopped mid-way (an accelerator's), the step still ends before its next llama_decode, and
    what its first decode (the short chunk, on its own) wrote is dropped."""
    from localinfer.backends.executor import StepInterrupted
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    with LlamaCppExecutor.open(default_model, n_slots=2, n_ctx=256, threads=1, n_batch=64, n_ubatch=64) as ex:
        ex.step([Chunk(1, (1, 2, 3), 0, False)])
        calls = []
        decode = ex._decode

        def first_then_interrupt(rows, **kw):
            out = decode(rows, **kw)
            calls.append(len(rows))
            ex.interrupt()
            return out
        ex._decode = first_then_interrupt
        with pytest.raises(StepInterrupted):
            ex.step([Chunk(0, tuple(range(100, 260)), 0, False), Chunk(1, (4,), 3, True)])   # four decodes
        del ex._decode
        assert calls == [1] and ex.cells_used() == 3 and ex.slot_len(0) == 0 and ex.slot_len(1) == 3
        assert set(ex.step([Chunk(1, (4,), 3, True)])) == {1}
