"""Serving hybrid and recurrent models with real llama.cpp: recurrent-state snapshots make prefix hits, chat turns,
lookup drafts and preemption work (SPEC.md §8.3: reuse from a snapshot only).

Tiny random-weight files of each layout (tests/support/tiny_archs.py: Qwen3.5's gated delta-net hybrid, Granite
4.0-H's Mamba-2 hybrid, LFM2's short-convolution hybrid, a pure Mamba-2, and Gemma 3's sliding window), one thread,
flash attention on.  A warm server's answer is compared with a cold one's (no prefix cache): the same tokens, and
log-probabilities within llama.cpp's batch noise (the warm one computes the prompt in other chunks).
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from tests.serve.test_http_support import LiveServer
from tests.support.ggufgen import write_tiny_arch
from tests.support.tiny_archs import TINY

openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")

HYBRIDS = ("qwen35", "granitehybrid", "lfm2")
NOISE = 1e-3        # log-probability: llama.cpp's own difference between prompt chunkings (measured: under 1e-4)
rng = np.random.default_rng(5)
FIRST = [int(t) for t in rng.integers(3, 200, 150)]
SECOND = FIRST + [int(t) for t in rng.integers(3, 200, 30)]
STORY = [{"role": "user", "content": "tell me a story about a cat and a dog"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrids")
    return {name: str(write_tiny_arch(root / f"{name}.gguf", TINY[name], seed=3))
            for name in (*HYBRIDS, "mamba2", "gemma3")}


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)


def _turns(srv) -> dict:
    """A document prompt and a longer one that starts with it, then a two-turn chat: the second answers, with
    log-probabilities."""
    c = _client(srv)
    c.completions.create(model="m", prompt=FIRST, max_tokens=6, temperature=0)
    doc = c.completions.create(model="m", prompt=SECOND, max_tokens=6, temperature=0, logprobs=5)
    first = c.chat.completions.create(model="m", messages=STORY, max_tokens=20, temperature=0)
    turn = STORY + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and then?"}]
    chat = c.chat.completions.create(model="m", messages=turn, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=3)
    return {"doc": doc, "chat": chat, "first_prompt": first.usage.prompt_tokens}


def _cached(reply) -> int:
    details = reply.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


@pytest.mark.parametrize("name", [*HYBRIDS, "mamba2", "gemma3"])
def test_a_second_turn_is_cached_and_answers_as_a_cold_server(name, models):
    warm_srv = LiveServer(models[name], parallel=2, ctx=2048, park=4, snapshot_stride=64)
    try:
        warm = _turns(warm_srv)
        m = warm_srv.wait_idle()
    finally:
        warm_srv.stop()
    cold_srv = LiveServer(models[name], parallel=2, ctx=2048, prefix_cache=False)
    try:
        cold = _turns(cold_srv)
    finally:
        cold_srv.stop()
    # the document: its first 144 tokens (the first prompt's last whole block) come from the cache
    assert _cached(warm["doc"]) == (len(FIRST) - 1) // 16 * 16 and _cached(cold["doc"]) == 0
    # the chat's second turn reuses at least the first turn's prompt, to its last whole block
    assert _cached(warm["chat"]) >= (warm["first_prompt"] - 1) // 16 * 16 > 0
    for kind in ("doc", "chat"):
        w, c = warm[kind].choices[0], cold[kind].choices[0]
        assert (w.text if kind == "doc" else w.message.content) == (c.text if kind == "doc" else c.message.content)
        lw = w.logprobs.token_logprobs if kind == "doc" else [t.logprob for t in w.logprobs.content]
        lc = c.logprobs.token_logprobs if kind == "doc" else [t.logprob for t in c.logprobs.content]
        assert len(lw) == len(lc) and max(abs(a - b) for a, b in zip(lw, lc)) < NOISE
    if name in ("gemma3",):          # attention only: no state to snapshot
        assert m["localinfer_snapshots"] == 0
    else:
        assert m["localinfer_snapshots_restored_total"] >= 2 and m["localinfer_snapshot_bytes"] > 0


def test_lookup_drafts_on_hybrids_give_plain_greedy_text(models):
    """A rejected draft restores the state saved before its verify and computes the accepted tokens again: with
    drafts the three hybrids answer as without, and some of their drafts were rejected (Granite's tiny file)."""
    prompt = (FIRST[:40] * 4)[:150]         # repeats: the drafter finds continuations to propose
    drafted = accepted = 0
    for name in HYBRIDS:
        texts, metrics = {}, {}
        for label, kw in (("lookup", {"draft_max": 6}), ("plain", {})):
            srv = LiveServer(models[name], parallel=2, ctx=2048, park=2, **kw)
            try:
                texts[label] = [_client(srv).completions.create(model="m", prompt=p, max_tokens=48, temperature=0)
                                .choices[0].text for p in (prompt, FIRST)]
                metrics[label] = srv.wait_idle()
            finally:
                srv.stop()
        assert texts["lookup"] == texts["plain"], name
        drafted += metrics["lookup"]["localinfer_spec_draft_tokens_total"]
        accepted += metrics["lookup"]["localinfer_spec_accepted_tokens_total"]
    assert 0 < accepted < drafted


def test_preemption_under_a_small_context_loses_nothing(models):
    """Four requests need more cells than the pool has: some are preempted (their state dropped with their KV) and
    resume from the prefix cache's snapshots, and each reply equals the one it gets alone."""
    prompts = [FIRST[i * 10:i * 10 + 100] for i in range(4)]
    srv = LiveServer(models["qwen35"], parallel=4, ctx=384, park=2, snapshot_stride=32)
    try:
        c = _client(srv)
        alone = [c.completions.create(model="m", prompt=p, max_tokens=40, temperature=0).choices[0].text
                 for p in prompts]
        before = srv.wait_idle()["localinfer_preemptions_total"]
        with cf.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: c.completions.create(model="m", prompt=p, max_tokens=40,
                                                                    temperature=0).choices[0].text, prompts))
        m = srv.wait_idle()
    finally:
        srv.stop()
    assert m["localinfer_preemptions_total"] > before
    assert together == alone


def test_a_soak_of_300_requests_leaks_no_snapshot(models):
    """Requests from five shared prefixes, four at a time, with few parked ids and a budget of 6 snapshots: every
    snapshot kept belongs to a block in the prefix cache, the budget holds, and once the parked requests give their
    slots up no snapshot, cell or block is left."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.serve.assembly import build_step_engine
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import SchedulerConfig
    from localinfer.serve.snapshots import SnapshotPolicy

    gen = np.random.default_rng(11)
    families = [[int(t) for t in gen.integers(3, 200, 48)] for _ in range(5)]
    ex = LlamaCppExecutor.open(models["granitehybrid"], n_slots=7, n_ctx=2048, threads=1, quiet=True)
    try:
        budget = 6 * ex.caps.state_bytes
        engine = build_step_engine(ex, SchedulerConfig(max_running=4), park_slots=3, snapshot_budget=budget,
                                   snapshot_policy=SnapshotPolicy(stride=32))
        snaps, blocks = engine.blocks.snapshots, engine.blocks
        peak = 0
        for i in range(300):
            tail = [int(t) for t in gen.integers(3, 200, int(gen.integers(1, 40)))]
            engine.add_request(Request(f"r{i}", tuple(families[i % 5] + tail), int(gen.integers(1, 6))))
            if i % 4 == 3:
                engine.run()
                peak = max(peak, snaps.bytes)
                assert all(blocks.has_hash(k) for k in snaps.keys())      # none outlives its block
                assert snaps.bytes == len(snaps) * ex.caps.state_bytes <= budget
                for r in list(engine.scheduler.requests):
                    engine.forget(r)
        assert snaps.restored > 50 and snaps.evicted > 0 and peak <= budget
        for rid in list(engine.parking.slot_of):
            engine.parking.give_up(rid)
        assert len(snaps) == 0 and snaps.bytes == 0
        assert ex.cells_used() == 0 and blocks.used == 0 and blocks.num_cached == 0
    finally:
        ex.close()


@pytest.mark.parametrize("together", [True, False])
def test_two_users_of_one_system_prompt_both_reuse_their_own_chats(together, models):
    """Two chats that share a system prompt, their first turns sent at once or one after the other: the second
    matches the first's blocks past any snapshot, computes them again once (its state saved where the prompts
    part), then takes the first's cells for them; each user's next turn restores its own first turn's state, and
    answers as a cold engine does."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.serve.assembly import build_step_engine
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import SchedulerConfig
    from localinfer.serve.snapshots import SnapshotPolicy

    gen = np.random.default_rng(3)
    system = [int(t) for t in gen.integers(3, 200, 100)]
    first = [system + [int(t) for t in gen.integers(3, 200, 50)] for _ in range(2)]

    def engine(ex, prefix_cache=True):
        return build_step_engine(ex, SchedulerConfig(max_running=2), park_slots=4, prefix_cache=prefix_cache,
                                 snapshot_policy=SnapshotPolicy(stride=1024))

    ex = LlamaCppExecutor.open(models["qwen35"], n_slots=6, n_ctx=2048, threads=1, quiet=True)
    try:
        eng = engine(ex)
        turn0 = []
        for u in range(2):
            turn0.append(eng.add_request(Request(f"u{u}t0", tuple(first[u]), 6)))
            if not together:
                eng.run()
        eng.run()
        second = [first[u] + turn0[u].output + [int(t) for t in gen.integers(3, 200, 20)] for u in range(2)]
        turn1 = [eng.add_request(Request(f"u{u}t1", tuple(second[u]), 6)) for u in range(2)]
        eng.run()
        assert turn0[1].cached == 0 if together else turn0[1].past_snapshot > 0
        assert eng.blocks.tables == {} and eng.parked >= 2
    finally:
        ex.close()
    for u in range(2):        # each second turn starts from its own first turn's state at least
        assert turn1[u].cached >= len(first[u]) // 16 * 16
    cold_ex = LlamaCppExecutor.open(models["qwen35"], n_slots=2, n_ctx=1024, threads=1, quiet=True)
    try:
        cold = engine(cold_ex, prefix_cache=False)
        alone = [cold.add_request(Request(f"c{u}", tuple(second[u]), 6)) for u in range(2)]
        cold.run()
    finally:
        cold_ex.close()
    assert [r.output for r in turn1] == [r.output for r in alone]


def test_the_next_turn_starts_from_the_replys_last_block(models):
    """A reply's state at the last block boundary it reached is kept: the next turn, which repeats the reply,
    restores it rather than the prompt's end."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.serve.assembly import build_step_engine
    from localinfer.serve.request import Request
    from localinfer.serve.scheduler import SchedulerConfig
    from localinfer.serve.snapshots import SnapshotPolicy

    first = FIRST[:100]
    ex = LlamaCppExecutor.open(models["lfm2"], n_slots=3, n_ctx=1024, threads=1, quiet=True)
    try:
        eng = build_step_engine(ex, SchedulerConfig(max_running=1), park_slots=2,
                                snapshot_policy=SnapshotPolicy(stride=0))
        one = eng.add_request(Request("one", tuple(first), 40))
        eng.run()
        two = eng.add_request(Request("two", tuple(first + one.output + [7, 8, 9]), 4))
        eng.run()
    finally:
        ex.close()
    held = len(first) + len(one.output) - 1          # the reply's last token is never computed
    assert len(one.output) == 40 and two.cached == held // 16 * 16 > (len(first) - 1) // 16 * 16


def test_serve_refuses_a_snapshot_stride_it_cannot_use(models, capsys):
    from localinfer.cli import main
    from localinfer.model.sources import default_model_path

    assert main(["serve", str(default_model_path()), "--snapshot-stride", "1024", "--port", "0"]) != 0
    assert "no recurrent layers" in capsys.readouterr().err          # an attention-only model
    assert main(["serve", models["qwen35"], "--snapshot-stride", "100", "--port", "0"]) != 0
    err = capsys.readouterr().err
    assert "--snapshot-stride 100" in err and "Traceback" not in err
