"""Offline batch generation: many prompts share one model through the step engine.

``generate_batch(model, prompts, ...) -> list[str]`` has the shape of vLLM's
``LLM.generate``: every prompt becomes a :class:`~localinfer.serve.request.Request`
with its own sampler (the parameters and seed it would get alone), the
:class:`~localinfer.serve.engine.StepEngine` (scheduler + block manager) steps them
``parallel`` at a time on a :class:`LlamaCppExecutor`, and each reply ends by
the rules of :class:`~localinfer.generation.runner.Runner`: an end-of-generation
token or a stop string (``"stop"``), ``max_tokens``, or the request's context
(``"length"``: a prompt of P tokens in a context of ``ctx`` gets at most
ctx − P + 1 tokens, as the Runner's reply does when its context fills).

Admission reserves P + G − 1 cells (the tokens a request of G outputs leaves in
KV), so no request runs out of KV halfway.  The default KV layout gives each
slot its own stream (``kv_unified=False``), where llama.cpp computes every
token exactly as alone (1 thread, flash attention on: tests/serve/test_batch.py);
``kv_unified=True`` shares one pool of cells, which is what prefix sharing
needs, but can reorder a sequence's cells after a request ends (see
:mod:`localinfer.backends.llamacpp.executor`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from localinfer.errors import ContextFullError, LocalinferError, UsageError
from localinfer.generation.sampling import SamplingParams, check_max_tokens
from localinfer.generation.text import ReplyText, check_stops
from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS, blocks_for
from localinfer.serve.assembly import build_step_engine
from localinfer.serve.request import FinishReason, Request
from localinfer.serve.scheduler import Policy, SchedulerConfig

DEFAULT_MAX_TOKENS = 256
DEFAULT_PARALLEL = 4


@dataclass
class BatchResult:
    """One finished request: its text, output tokens (no end-of-generation token), why it ended, token times."""

    text: str
    tokens: list[int]
    finish_reason: str               # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    start_s: float                   # executor clock when the batch started
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0             # times its KV was dropped (on-demand admission) and recomputed
    recomputed_tokens: int = 0       # tokens computed again after those preemptions
    cached_tokens: int = 0           # prompt tokens copied from a running request at admission

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start_s if self.token_times else None


class _Reply:
    """A request's text as Runner builds it (``ReplyText``), with its output tokens and their times."""

    def __init__(self, vocab, stops: list[str], eos: frozenset[int]):
        self.eos = eos
        self.reply = ReplyText(vocab.token_bytes, stops)
        self.parts: list[str] = []
        self.tokens: list[int] = []
        self.times: list[float] = []

    @property
    def stopped(self) -> bool:
        return self.reply.stopped

    def add(self, token: int, now: float) -> bool:
        """Take one output token; True when a stop string ended the reply."""
        if token in self.eos:
            return False                 # the request finishes with STOP; the token is not part of the text
        self.tokens.append(token)
        self.times.append(now)
        self.parts.append(self.reply.feed(token))
        return self.stopped

    def text(self) -> str:
        return "".join(self.parts) + self.reply.flush()


def run_batch(executor, vocab, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None, *,
              max_tokens: int = DEFAULT_MAX_TOKENS, parallel: int | None = None, ctx: int | None = None,
              chunk: int | None = None, stop: Sequence[str] = (), block_tokens: int | None = None,
              prefix_cache: bool = True, admission: str = "reserve", kv_blocks: int | None = None,
              ignore_eos: bool = False) -> list[BatchResult]:
    """Replies to prompts (token ids) through ``executor`` and the step engine; results in prompt order.

    ``vocab`` gives ``token_bytes`` and ``eos_ids`` (an engine or a vocabulary);
    ``ctx`` is each request's context (default: an equal share of the cells);
    ``chunk`` switches to chunked prefill (at most ``chunk`` prompt tokens of a request per step);
    ``block_tokens``: the KV block size (default: the executor's ``block_size``, else 16);
    ``prefix_cache``: a prompt whose first full blocks a running request holds copies them (``executor.copy``),
    or, on an executor that ``restores_cached_prefix`` (torch), reads them from the pool where they stayed;
    ``admission``: ``"reserve"`` (prompt + max output up front) or ``"on_demand"`` (preempting the newest
    request, recomputed later, when ``kv_blocks`` — default: all the cells — run out);
    ``ignore_eos`` lets replies run through end-of-generation tokens (benchmarks).
    """
    check_max_tokens(max_tokens)
    stops = check_stops(stop)
    params = params or SamplingParams()
    caps = executor.caps
    block_tokens = caps.block_size or block_tokens or DEFAULT_BLOCK_TOKENS
    parallel = min(parallel or executor.n_slots, executor.n_slots)
    if ctx is None:
        ctx = caps.n_cells // parallel // block_tokens * block_tokens if caps.unified else caps.slot_cells
    per_slot = blocks_for(ctx, block_tokens)
    pool = caps.n_cells // block_tokens if caps.unified else parallel * (caps.slot_cells // block_tokens)
    if ctx > caps.slot_cells or parallel * per_slot > pool:
        raise UsageError(f"{parallel} requests of {ctx} positions need {parallel * per_slot * block_tokens} KV "
                         f"cells ({caps.slot_cells} per slot); the context has {caps.n_cells}",
                         flag="--parallel", hint="use a smaller ctx or fewer parallel requests")
    if chunk is not None and chunk < 1:
        raise UsageError(f"the prefill chunk must be >= 1 token, got {chunk}", flag="--chunk")
    config = SchedulerConfig(policy=Policy.CONTINUOUS if chunk is None else Policy.CHUNKED, max_running=parallel,
                             chunk_tokens=chunk or SchedulerConfig.chunk_tokens, admission=admission)
    if kv_blocks is not None:
        pool = min(pool, kv_blocks)
    engine = build_step_engine(executor, config, block_tokens=block_tokens, num_blocks=pool, prefix_cache=prefix_cache)
    start = executor.clock()
    stop_tokens = frozenset() if ignore_eos else frozenset(vocab.eos_ids)
    requests, replies = [], {}
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {i} is empty", flag="-p")
        if len(p) > ctx:
            raise ContextFullError(f"prompt {i} is {len(p)} tokens; a request's context holds {ctx}",
                                   needed=len(p), available=ctx, hint="use a larger ctx or fewer parallel requests")
        r = Request(str(i), tuple(p), min(max_tokens, ctx - len(p) + 1), arrival_s=start, sampling=params,
                    stop_tokens=stop_tokens)
        requests.append(engine.add_request(r))
        replies[r.id] = _Reply(vocab, stops, stop_tokens)
    try:
        while engine.unfinished:
            events = engine.step()
            for ev in events:
                if ev.token is not None and replies[ev.request_id].add(ev.token, ev.time_s):
                    engine.cancel(ev.request_id)
            if not events and not engine.scheduler.running:
                raise LocalinferError("the batch stalled: requests wait but none can be admitted")
    finally:
        for r in requests:
            if not r.finished:
                engine.cancel(r.id)
    out = []
    for r in requests:
        rep = replies[r.id]
        if r.finish_reason is FinishReason.ERROR:
            raise LocalinferError(f"request {r.id} failed: {r.error}")
        reason = "stop" if rep.stopped or r.finish_reason is FinishReason.STOP else "length"
        out.append(BatchResult(rep.text(), rep.tokens, reason, len(r.prompt), start, rep.times,
                               preemptions=r.preemptions, recomputed_tokens=r.recomputed,
                               cached_tokens=r.cached))
    return out


def generate_batch(model: str | os.PathLike | None, prompts: Sequence[str | Sequence[int]], *,
                   max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float | None = None, seed: int | None = None,
                   sampling: SamplingParams | None = None, parallel: int = DEFAULT_PARALLEL,
                   backend: str = "llama.cpp", threads: int | None = None, ctx: int | None = None,
                   flash_attn: bool | None = True, type_k: str = "f16", type_v: str = "f16",
                   n_gpu_layers: int = -1, ubatch: int = 512, chunk: int | None = None, stop: Sequence[str] = (),
                   chat: bool = False, kv_unified: bool = False) -> list[str]:
    """Replies to many prompts, ``parallel`` at a time in one llama.cpp context (``backend="torch"``:
    cuda_backend's paged executor); texts in prompt order.

    ``model`` is a GGUF path (None: the embedded default).  Prompts are text
    (tokenised with BOS; ``chat=True`` wraps each as one user message in the
    model's chat template) or token ids.  ``sampling`` gives every parameter
    (default: SamplingParams()); ``temperature`` and ``seed`` override its fields
    (``temperature=0``: greedy).  ``ctx`` is each request's context (default:
    longest prompt + max_tokens, at most the trained context).  Replies equal what Runner gives each
    prompt alone (same threads and flash attention) for prompts under 64 tokens; for longer ones when
    both run with ``ubatch`` < 64 (see :mod:`localinfer.backends.llamacpp.executor`).
    """
    from localinfer.backends import registry

    if registry.canonical(backend) not in registry.serving_backends():
        names = " or ".join(registry.serving_backends())
        raise UsageError(f"generate_batch runs on the {names} executor; backend {backend!r} has none yet",
                         flag="--backend", hint="use backend='llama.cpp', or Runner for one prompt at a time")
    params = sampling or SamplingParams()
    changes = {k: v for k, v in (("temperature", temperature), ("seed", seed)) if v is not None}
    params = params.with_(**changes) if changes else params
    check_max_tokens(max_tokens)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise UsageError(f"parallel must be a positive integer, got {parallel!r}", flag="--parallel")
    if not prompts:
        return []
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.vocab import VocabOnly
    from localinfer.model.sources import default_model_path
    from localinfer.model.spec import ModelSpec

    path = os.fspath(model) if model is not None else str(default_model_path())
    spec = ModelSpec.from_gguf(path)
    vocab = VocabOnly(path)
    try:
        token_lists = _tokenize(vocab, spec, prompts, chat)
    finally:
        vocab.close()
    parallel = min(parallel, len(prompts))
    if ctx is None:
        ctx = max(len(t) for t in token_lists) + max_tokens
        ctx = min(ctx, spec.n_ctx_train) if spec.n_ctx_train else ctx
    # every slot holds ctx positions, in whole blocks; the backend's memory model pads that as it allocates
    memory = registry.memory_model(backend)
    slot = memory.slot_cells(blocks_for(ctx) * DEFAULT_BLOCK_TOKENS) if memory is not None else ctx
    plan = LoadPlan(path, n_ctx=parallel * slot, n_seq=parallel, n_threads=threads, flash_attn=flash_attn,
                    n_ubatch=ubatch, type_k=type_k, type_v=type_v, n_gpu_layers=n_gpu_layers,
                    options={"kv_unified": kv_unified, "quiet": True})
    with registry.open_executor(plan, backend) as ex:
        results = run_batch(ex, ex.vocab, token_lists, params, max_tokens=max_tokens, parallel=parallel, ctx=ctx,
                            chunk=chunk, stop=stop)
    return [r.text for r in results]


def _tokenize(vocab, spec, prompts, chat: bool) -> list[list[int]]:
    out, template = [], None
    for p in prompts:
        if not isinstance(p, str):
            out.append([int(t) for t in p])
        elif chat:
            if template is None:
                from localinfer.model.templates import template_with_vocab

                template = template_with_vocab(spec, vocab)
            out.append(template.tokens(vocab, [{"role": "user", "content": p}]))
        else:
            out.append(vocab.tokenize(p, add_bos=True))
    return out

