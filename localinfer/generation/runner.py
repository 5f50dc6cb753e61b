"""Generation on any engine: token steps -> a stream of chunks -> a string.

``Runner.stream`` is the middle layer that ``run``, ``chat`` and ``bench``
consume: it reuses the cached prefix of the previous request, prefills the
rest with logits for the last position only, samples the first token from
them, then calls a :class:`~localinfer.generation.decoding.Decoder` (plain or
prompt-lookup) step after step with that token pending, yielding one
:class:`TextChunk` per emitted token and a last one carrying the finish reason
and the timings.  (Prefilling the whole prompt, rather than ``prompt[:-1]``
and a first decode step, saves one forward pass of TTFT.)

Finish reasons: ``"stop"`` (an end-of-generation token or a stop string) and
``"length"`` (``max_tokens`` reached, or the context is full:
``Timings.context_full``).  Ctrl-C propagates as KeyboardInterrupt; the KV
cache is left holding exactly what the runner's bookkeeping says.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from localinfer.backends.engine import Engine
from localinfer.errors import ContextFullError, LocalinferError, UsageError
from localinfer.generation.decoding import Decoder, DecodeStats, History, PlainDecoder
from localinfer.generation.sampling import Sampler, SamplingParams, check_max_tokens
from localinfer.generation.text import ReplyText, check_stops
from localinfer.util.stats import percentile

DEFAULT_MAX_TOKENS = 512
MAX_STATES = 8       # saved recurrent states per sequence (prompt ends and partings of the latest turns)


@dataclass
class Timings:
    """What one generation cost.  Seconds throughout; ``itl`` has one entry per token after the first."""

    prompt_tokens: int = 0
    cached_tokens: int = 0       # prompt prefix reused from the previous request's KV
    generated: int = 0           # tokens emitted, an end-of-generation token included
    ttft: float | None = None    # request start -> first token (prefill + first step)
    itl: list[float] = field(default_factory=list)
    total: float = 0.0
    context_full: bool = False

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float | None:
        return self.prefill_tokens / self.ttft if self.ttft else None

    @property
    def decode_seconds(self) -> float:
        return sum(self.itl)

    @property
    def decode_tok_s(self) -> float | None:
        return len(self.itl) / self.decode_seconds if self.itl and self.decode_seconds > 0 else None

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prefill_tokens, "generated_tokens": self.generated,
            "ttft_s": self.ttft, "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s, "decode_s": self.decode_seconds,
            "itl_p50_s": percentile(self.itl, 0.5), "itl_p95_s": percentile(self.itl, 0.95),
            "total_s": self.total, "context_full": self.context_full,
        }


@dataclass
class TextChunk:
    """One step of a stream: new text (may be empty while bytes or a stop string are pending)."""

    text: str
    token: int | None            # None on the final chunk
    finish_reason: str | None = None
    timings: Timings | None = None
    stats: DecodeStats | None = None


@dataclass
class Generation:
    """A finished reply."""

    text: str
    tokens: list[int]
    finish_reason: str
    timings: Timings
    stats: DecodeStats

    def as_dict(self) -> dict:
        return {"text": self.text, "finish_reason": self.finish_reason, "tokens": len(self.tokens),
                "timings": self.timings.as_dict(), "decode": self.stats.as_dict()}


class Runner:
    """Drives one engine; remembers what each sequence's KV holds to reuse prefixes."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cached: dict[int, list[int]] = {}
        self._states: dict[int, list] = {}      # seq -> saved recurrent states (engines that cannot trim a tail)
        self._part: dict[int, int] = {}         # seq -> where the new prompt left the cached one past every state

    def cached(self, seq: int = 0) -> list[int]:
        """Token ids currently in sequence seq's KV cache."""
        return list(self._cached.get(seq, ()))

    def reset(self, seq: int = 0) -> None:
        """Empty sequence seq's KV cache."""
        self.engine.trim(0, seq)
        self._cached[seq] = []
        self._states.pop(seq, None)
        self._part.pop(seq, None)

    def _reuse(self, prompt: Sequence[int], seq: int) -> list[int]:
        cached = self._cached.get(seq, [])
        if self.engine.kv_len(seq) != len(cached):
            cached = []
        n = 0
        limit = min(len(cached), len(prompt) - 1)
        while n < limit and cached[n] == prompt[n]:
            n += 1
        if self.engine.kv_len(seq) > n:
            if n and not self.engine.trims_tail:     # a recurrent state goes back only to where it was saved
                state = max((s for s in self._states.get(seq, ()) if s.n_tokens <= n), key=lambda s: s.n_tokens,
                            default=None)
                self._part[seq] = n     # the prompts part there: save the state there this time
                if state is not None:
                    self.engine.rewind(state, seq)
                    n = state.n_tokens
                else:
                    n = 0
            if self.engine.kv_len(seq) > n:
                self.engine.trim(n, seq)
        states = self._states.get(seq)
        if states:
            states[:] = [s for s in states if s.n_tokens <= n]    # saved for tokens no longer held
        self._cached[seq] = context = list(prompt[:n])
        return context

    def _save_state(self, seq: int, n_tokens: int) -> None:
        """Keep the recurrent state at the prompt's end (an engine that cannot trim a tail): a regenerate, an edited
        last turn or the next turn restores it instead of recomputing the conversation; and where the prompt left
        the cached tokens past every saved state (a system prompt's end after a context shift, an edited turn's
        start), since the next prompt tends to leave them there again."""
        if self.engine.trims_tail or not n_tokens or self.engine.kv_len(seq) != n_tokens:
            return
        states = self._states.setdefault(seq, [])
        states.append(self.engine.snapshot(seq))
        del states[:-MAX_STATES]

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
               max_tokens: int = DEFAULT_MAX_TOKENS, stop: Sequence[str] = (), decoder: Decoder | None = None,
               sampler: Sampler | None = None, seq: int = 0, ignore_eos: bool = False,
               constraint=None) -> Iterator[TextChunk]:
        """Generate a reply to prompt token ids, one chunk per token.

        ``ignore_eos`` bans end-of-generation tokens (benchmarks that need exactly max_tokens).  ``constraint``
        (a :class:`~localinfer.generation.constraints.Constraint`, or the sampler's own) keeps the reply in its
        grammar; the reply ends, reason stop, when the grammar is complete.
        """
        engine = self.engine
        check_max_tokens(max_tokens)
        stops = check_stops(stop)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise UsageError("the prompt is empty", flag="-p")
        if len(prompt) > engine.n_ctx:
            raise ContextFullError(f"the prompt is {len(prompt)} tokens; the context holds {engine.n_ctx}",
                                   needed=len(prompt), available=engine.n_ctx,
                                   hint="use a larger --ctx or a shorter prompt")
        sampler = sampler or Sampler(params or SamplingParams(), banned=engine.eos_ids if ignore_eos else ())
        if constraint is not None:
            sampler.constraint = constraint
        decoder = decoder or PlainDecoder()
        t0 = time.perf_counter()
        tm = Timings(prompt_tokens=len(prompt))
        context = self._reuse(prompt, seq)
        tm.cached_tokens = len(context)
        try:
            part = self._part.pop(seq, 0)
            if len(context) < part < len(prompt):
                engine.eval(prompt[len(context):part], logits_at=[], seq=seq)
                context.extend(prompt[len(context):part])
                self._save_state(seq, part)
            logits = engine.eval(prompt[len(context):], logits_at=[-1], seq=seq)[0]
            context.extend(prompt[len(context):])
            decoder.start(prompt)
            first = sampler.sample(logits, context)
            chunks = self._decode(context, first, sampler, decoder, max_tokens, stops, seq, tm, t0)
            yield next(chunks)
            self._save_state(seq, len(prompt))     # after the first token is out (the KV still holds the prompt)
            yield from chunks
        finally:
            self._settle(context, seq)

    def _settle(self, context: list[int], seq: int) -> None:
        """Make the KV and the bookkeeping agree after a finished or interrupted stream."""
        engine = self.engine
        try:
            n = engine.kv_len(seq)
        except LocalinferError:  # the engine was closed under a suspended stream
            return
        if n > len(context):
            engine.trim(len(context), seq)
        del context[n:]
        self._cached[seq] = context

    def _decode(self, context, first, sampler, decoder, max_tokens, stops, seq, tm, t0) -> Iterator[TextChunk]:
        """Emit ``first`` (sampled from the prefill's logits), then decoder steps until a finish reason.

        State between rounds: the KV holds ``context``; ``emitted[-1]`` is pending
        (emitted, not yet evaluated).  ``kv_base`` is the KV length just before
        ``emitted[0]``; stopping after ``emitted[i]`` rewinds the KV to ``kv_base + i``.
        """
        engine = self.engine
        reply, reason, last = ReplyText(engine.token_bytes, stops), None, None
        grammar = sampler.constraint
        emitted, kv_base = [first], len(context)
        while True:
            now = time.perf_counter()
            for i, tok in enumerate(emitted):
                tm.generated += 1
                if last is None:
                    tm.ttft = now - t0
                else:
                    tm.itl.append(now - last)
                last = now
                text = ""
                if engine.is_eos(tok):
                    reason = "stop"
                else:
                    text = reply.feed(tok)
                    if reply.stopped or grammar is not None and grammar.stopped_after(tm.generated):
                        reason = "stop"
                if reason is None and tm.generated >= max_tokens:
                    reason = "length"
                if reason is not None:
                    if engine.trims_tail or engine.kv_len(seq) <= kv_base + i:
                        engine.trim(kv_base + i, seq)
                        del context[kv_base + i:]
                    # else a recurrent state keeps the accepted drafts past the stop: the KV and context hold them
                    if not engine.is_eos(tok):
                        yield TextChunk(text, tok, timings=tm, stats=decoder.stats)
                    break
                yield TextChunk(text, tok, timings=tm, stats=decoder.stats)
            if reason is not None:
                break
            pending = emitted[-1]
            if engine.kv_len(seq) + 1 > engine.n_ctx:
                reason, tm.context_full = "length", True
                break
            try:
                emitted = decoder.step(engine, context, pending, sampler, seq)
            except ContextFullError:  # drafts ran past the context: one plain step still fits
                emitted = _plain_step(engine, context, pending, sampler, seq, decoder.stats)
            context.append(pending)
            context.extend(emitted[:-1])
            kv_base = len(context) - len(emitted) + 1
        tail = reply.flush()
        tm.total = time.perf_counter() - t0
        yield TextChunk(tail, None, finish_reason=reason, timings=tm, stats=decoder.stats)

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None, **kw) -> Generation:
        """The whole reply as one string (``stream`` collected)."""
        parts, tokens, chunk = [], [], None
        for chunk in self.stream(prompt, params, **kw):
            parts.append(chunk.text)
            if chunk.token is not None:
                tokens.append(chunk.token)
        return Generation("".join(parts), tokens, chunk.finish_reason, chunk.timings, chunk.stats)


def _plain_step(engine, context, pending, sampler, seq, stats: DecodeStats) -> list[int]:
    t0 = time.perf_counter()
    logits = engine.eval([pending], seq=seq)[0]
    token = sampler.sample(logits, History(context, len(context), [pending]))
    stats.rounds += 1
    stats.emitted += 1
    stats.round_times.append(time.perf_counter() - t0)
    return [token]
