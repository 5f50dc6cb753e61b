"""Prompt-lookup speculative decoding: draft by n-gram lookup, verify in one batch.

A round (``LookupDecoder.step``) has four parts, all through the engine contract:

1. Draft.  Keep copying from where the last round's source left off while it
   predicts the output; otherwise find the longest suffix n-gram of the history
   (prompt + output) seen before, ``ngram_max`` down to ``ngram_min``, take the
   occurrence whose preceding tokens agree longest with the history, and
   propose the k tokens that followed it.  ``NgramIndex`` is updated per
   emitted token (a few dictionary writes), so a round costs microseconds at
   any context length.
2. Verify.  ``engine.eval([pending, *draft])`` with logits at every position.
   The sampler draws the token at each position from exactly the distribution
   plain decoding would use there; the round keeps drafts while the draw equals
   the draft, and ends with the first draw that differs (or one bonus draw when
   all k agree).  Greedy: the longest agreeing prefix plus the target's token.
   Sampling: the draft x is accepted with probability p(x) = min(1, p(x)/q(x))
   for the point mass q = δ_x, and a rejected draw is distributed as
   (p - q)+ / (1 - p(x)), the normalised residual (docs/speculation.md) - so the output
   distribution is plain sampling's, and with a seeded sampler the random
   stream is consumed exactly as plain decoding consumes it.
3. Roll back.  ``engine.trim`` cuts the rejected drafts out of the KV (a recurrent model's engine, which cannot
   cut, restores the state saved before the verify and evaluates the accepted tokens again).
4. Adapt.  k is chosen each round from the learnt acceptance a(L) at the
   source's agreement length L (``AcceptanceModel``) and the engine's measured
   cost T(m) of verifying m tokens (``CostModel``), by the marginal rule:
   lengthen while ΔT/ΔN < T/N, E[N] = 1 + Σ_j Π_{i<=j} a_i (``choose_draft_length``).
   Nothing to copy, or drafts that do not pay on this backend: plain rounds.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

from localinfer.backends.engine import Engine
from localinfer.errors import UsageError
from localinfer.generation.decoding import DecodeStats, History, TokenSampler
from localinfer.plan.speculation import MAX_DRAFT, choose_draft_length


class NgramIndex:
    """The token history and where each n-gram (n_min..n_max) occurred.

    ``_maps[i][gram] = p`` (n = n_min + i) means ``tokens[p - n:p] == gram``
    with p the latest such position below the last token, so ``tokens[p]`` is
    the token that followed; ``_prev[i][p]`` chains to the occurrence before
    (-1 at the first).  Appending a token does n_max - n_min + 1 dictionary
    writes and list appends.
    """

    def __init__(self, n_min: int, n_max: int, tokens: Sequence[int] = ()):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_min, n_max + 1)]
        self._prev: list[list[int]] = [[] for _ in range(n_min, n_max + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, n_min = self.tokens, self.n_min
        levels = list(zip(self._maps, self._prev))
        for t in tokens:
            end = len(toks)
            toks.append(t)
            # the n-grams ending just before the new token now have a continuation
            for i, (index, prev) in enumerate(levels):
                n = n_min + i
                if end < n:
                    prev.append(-1)
                    continue
                key = tuple(toks[end - n:end])
                prev.append(index.get(key, -1))
                index[key] = end

    def match(self) -> tuple[int, int]:
        """(n, p): the longest suffix n-gram seen before and where its latest continuation starts; (0, -1) if none."""
        toks, size = self.tokens, len(self.tokens)
        for i in range(len(self._maps) - 1, -1, -1):
            n = self.n_min + i
            if size > n:
                p = self._maps[i].get(tuple(toks[size - n:]))
                if p is not None:
                    return n, p
        return 0, -1

    def best_match(self, cap: int, candidates: int = 8) -> tuple[int, int]:
        """(p, agreement): among the latest ``candidates`` occurrences of the longest suffix n-gram,
        the one whose preceding tokens agree longest with the history (ties: the earlier); (-1, 0) if none."""
        n, p = self.match()
        if n == 0:
            return -1, 0
        prev = self._prev[n - self.n_min]
        best_p, best_a = p, self.agreement(p, n, cap)
        q = prev[p]
        for _ in range(candidates - 1):
            if q < 0:
                break
            a = self.agreement(q, n, cap)
            if a >= best_a:
                best_p, best_a = q, a
            q = prev[q]
        return best_p, best_a

    def agreement(self, p: int, at_least: int, cap: int) -> int:
        """How many of the last tokens equal those before position p (known to be >= at_least), up to cap."""
        toks, size = self.tokens, len(self.tokens)
        n = at_least
        while n < cap and n < p and toks[p - 1 - n] == toks[size - 1 - n]:
            n += 1
        return n

    def continuation(self, p: int, k: int) -> list[int]:
        """k tokens from position p; past the end it keeps copying its own output (periodic text)."""
        toks, size = self.tokens, len(self.tokens)
        out = toks[p:p + k]
        while len(out) < k:
            q = p + len(out)
            out.append(toks[q] if q < size else out[q - size])
        return out


class CostModel:
    """Measured time T(m) of a round that verifies m tokens (pending + m - 1 drafts).

    Single rounds are unreliable on a busy machine, so the curve is a line
    T(m) = T(1) + s·(m - 1): T(1) is the median of recent plain rounds and s is
    fitted through it to the per-size medians of recent drafting rounds (least
    squares, each median weighted by its rounds), pulled towards ``prior_slope``
    × T(1) by ``PRIOR_WEIGHT`` pseudo-rounds.  A size measured ``TRUSTED``
    times uses its own median instead, which keeps real jumps (padding to a
    graph shape).  A new time is clipped to [1/3, 3]× the current estimate, so
    one descheduled round cannot switch drafting off.
    """

    PRIOR_WEIGHT = 1.0
    TRUSTED = 3
    CLIP = 3.0

    def __init__(self, max_tokens: int, *, window: int = 16, prior_slope: float = 0.25):
        self.max_tokens = max_tokens
        self.prior_slope = prior_slope
        self._samples = [deque(maxlen=window) for _ in range(max_tokens + 1)]
        self._curve: list[float] | None = None
        self._fixed = False
        self._predict: Callable[[int], float] | None = None

    @classmethod
    def fixed(cls, seconds: Sequence[float]) -> CostModel:
        """A curve given outright, ``seconds[m - 1]`` for m = 1..len, that measurements do not change."""
        model = cls(len(seconds))
        model._curve, model._fixed = [float(t) for t in seconds], True
        return model

    @classmethod
    def predicted(cls, seconds: Callable[[int], float], max_tokens: int) -> CostModel:
        """A fixed curve T(m) = ``seconds(m)`` for m = 1..max_tokens, computed only when first read (a
        proposer that finds nothing to draft never asks)."""
        model = cls(max_tokens)
        model._fixed, model._predict = True, seconds
        return model

    def add(self, m: int, seconds: float) -> None:
        """Record the time of a round that verified m tokens."""
        if self._fixed or not 1 <= m <= self.max_tokens:
            return
        curve = self.curve()
        if curve is not None:
            seconds = min(max(seconds, curve[m - 1] / self.CLIP), curve[m - 1] * self.CLIP)
        self._samples[m].append(seconds)
        self._curve = None

    def measured(self, m: int) -> float | None:
        """Median of the recent rounds that verified m tokens (None if there were none)."""
        if self._fixed:
            self.curve()
            return self._curve[m - 1] if 1 <= m <= len(self._curve) else None
        s = self._samples[m] if 1 <= m <= self.max_tokens else None
        return median(s) if s else None

    def curve(self) -> list[float] | None:
        """[T(1), ..., T(max_tokens)] (index m - 1), or None before any measurement."""
        if self._curve is None and self._predict is not None:
            self._curve = [max(float(self._predict(m)), 1e-9) for m in range(1, self.max_tokens + 1)]
        if self._curve is None:
            known = [(m, median(s), len(s)) for m, s in enumerate(self._samples) if s]
            if not known:
                return None
            if known[0][0] == 1:
                t1 = known[0][1]
            else:  # only drafting rounds so far: the prior slope gives the intercept
                m0, t0, _ = known[0]
                t1 = t0 / (1 + self.prior_slope * (m0 - 1))
            num = self.PRIOR_WEIGHT * self.prior_slope * t1
            den = self.PRIOR_WEIGHT
            for m, t, w in known:
                num += w * (m - 1) * (t - t1)
                den += w * (m - 1) ** 2
            slope = max(num / den, 0.0)
            trusted = {m: t for m, t, w in known if w >= self.TRUSTED}
            self._curve = [trusted.get(m, t1 + slope * (m - 1)) for m in range(1, self.max_tokens + 1)]
        return self._curve


class AcceptanceModel:
    """The chance a(L) that the next draft token is accepted, given the agreement length L.

    L is how many of the latest history tokens equal the tokens before the
    draft's source: the n-gram matched, grown by every token the copy has
    kept since.  A long agreement is a copy in progress, a short one a
    coincidence, so a round with L drafts from a(L), a(L+1), ... .  Estimates
    are kept per bucket of L (1, 2, 3, 4-5, 6-7, 8-11, ... up to 64+), decay by
    ``decay`` per observation so they follow the text, and start from the
    prior L / (L + 3) worth ``PRIOR_WEIGHT`` observations.
    """

    PRIOR_WEIGHT = 2.0
    MAX_AGREEMENT = 64

    def __init__(self, *, decay: float = 0.98):
        self.decay = decay
        n = _bucket(self.MAX_AGREEMENT) + 1
        self._acc = [0.0] * n
        self._tot = [0.0] * n
        rep = [next(x for x in range(1, self.MAX_AGREEMENT + 1) if _bucket(x) == b) for b in range(n)]
        self._prior = [x / (x + 3) for x in rep]

    def observe(self, agreement: int, tried: int, accepted: int) -> None:
        """A round drafted at ``agreement`` tested ``tried`` positions and kept the first ``accepted``."""
        d = self.decay
        for i in range(tried):
            b = _bucket(agreement + i)
            self._acc[b] = self._acc[b] * d + (i < accepted)
            self._tot[b] = self._tot[b] * d + 1.0

    def rates(self, agreement: int, k: int) -> list[float]:
        """[a_1, ..., a_k] for a draft whose source agrees with the last ``agreement`` tokens."""
        w = self.PRIOR_WEIGHT
        out = []
        for i in range(k):
            b = _bucket(agreement + i)
            out.append((self._acc[b] + w * self._prior[b]) / (self._tot[b] + w))
        return out


def _bucket(agreement: int) -> int:
    """1, 2, 3 alone; then two buckets per doubling (4-5, 6-7, 8-11, 12-15, ...), 64 and above last."""
    x = min(max(agreement, 1), AcceptanceModel.MAX_AGREEMENT)
    if x < 4:
        return x - 1
    top = x.bit_length() - 1
    return 3 + 2 * (top - 2) + (x >> (top - 1) & 1)


@dataclass
class LookupStats(DecodeStats):
    """DecodeStats plus the plain per-token time measured by the same decoder (when it ran plain rounds)."""

    plain_seconds_per_token: float | None = None

    @property
    def speedup(self) -> float | None:
        spt = self.seconds_per_token
        if not self.plain_seconds_per_token or not spt:
            return None
        return self.plain_seconds_per_token / spt

    def as_dict(self) -> dict:
        out = super().as_dict()
        out["plain_seconds_per_token"] = self.plain_seconds_per_token
        out["speedup"] = None if self.speedup is None else round(self.speedup, 4)
        return out


_ENGINE_COSTS: weakref.WeakKeyDictionary[Engine, dict[int, CostModel]] = weakref.WeakKeyDictionary()


def engine_cost(engine: Engine, max_tokens: int) -> CostModel:
    """The cost curve measured on this engine so far, shared by every LookupDecoder that uses it."""
    try:
        per_size = _ENGINE_COSTS.setdefault(engine, {})
    except TypeError:  # an engine that cannot be weakly referenced measures per decoder
        return CostModel(max_tokens)
    return per_size.setdefault(max_tokens, CostModel(max_tokens))


@dataclass
class Draft:
    """One round's proposal: the tokens, where they were copied from, and how well that source agrees."""

    tokens: list[int]
    source: int = -1    # position in the history the draft copies from (-1: no match)
    agreement: int = 0  # latest history tokens equal to those before the source


class LookupDecoder:
    """Prompt-lookup speculative decoding behind the shared ``Decoder`` step signature.

    ``ngram_max``/``ngram_min``: longest and shortest suffix n-gram looked up;
    ``draft_max``: most drafts per round; ``adaptive``: choose the length each
    round from measured acceptance and cost (else always draft ``draft_max``
    when there is a match); ``cost``: a given cost curve instead of measuring.
    Output equals plain decoding's (greedy: token for token up to near-ties
    in batched numerics; sampling: in distribution, and token for token for a
    seeded sampler).
    """

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2, draft_max: int = 16, adaptive: bool = True,
                 cost: CostModel | None = None):
        for name, value in (("ngram_max", ngram_max), ("ngram_min", ngram_min), ("draft_max", draft_max)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DRAFT:
                flag = "--draft-max" if name == "draft_max" else "--lookup-ngram"
                raise UsageError(f"{name} must be a whole number from 1 to {MAX_DRAFT}, got {value!r}", flag=flag)
        if ngram_min > ngram_max:
            raise UsageError(f"ngram_min {ngram_min} is larger than ngram_max {ngram_max}", flag="--lookup-ngram",
                             hint="the lookup n-gram size is the longest match tried; use at least the minimum")
        self.ngram_max, self.ngram_min, self.draft_max = ngram_max, ngram_min, draft_max
        self.adaptive = adaptive
        self.cost = cost or CostModel(draft_max + 1)
        self._own_cost = cost is not None
        self._engine_id: int | None = None
        self.index = NgramIndex(ngram_min, ngram_max)
        self.start(())

    def start(self, prompt: Sequence[int]) -> None:
        """Index a new prompt; acceptance is relearnt, the engine's measured cost curve is kept.

        A prompt that extends the history already indexed (the next turn of a
        chat) only indexes its new tokens.
        """
        have = self.index.tokens
        if have and len(prompt) >= len(have) and list(prompt[:len(have)]) == have:
            self.index.extend(prompt[len(have):])
        else:
            self.index = NgramIndex(self.ngram_min, self.ngram_max, prompt)
        self.acceptance = AcceptanceModel()
        self.stats = LookupStats()
        self._following = -1  # where the copy in progress continues, or -1
        self._agreement = 0

    def step(self, engine: Engine, context: list[int], pending: int, sampler: TokenSampler, seq: int = 0) -> list[int]:
        """One round: draft, verify pending + drafts in one eval, trim rejected drafts, learn."""
        t0 = time.perf_counter()
        if self._engine_id != id(engine):
            self._engine_id = id(engine)
            if not self._own_cost:
                self.cost = engine_cost(engine, self.draft_max + 1)
        draft = self.propose(context, pending, room=engine.n_ctx - len(context) - 1, is_eos=engine.is_eos)
        t1 = time.perf_counter()
        # a recurrent state cannot be cut back: saved before the verify, restored if a draft is rejected
        state = engine.snapshot(seq) if draft.tokens and not engine.trims_tail and context else None
        rows = engine.eval([pending, *draft.tokens], logits_at=range(len(draft.tokens) + 1), seq=seq)
        t2 = time.perf_counter()
        emitted = self._verify(rows, draft.tokens, sampler)
        n_acc = len(emitted) - 1
        if n_acc < len(draft.tokens):
            if state is None:
                engine.trim(len(context) + 1 + n_acc, seq)
            else:      # back to before the verify, then the kept tokens again
                engine.rewind(state, seq)
                engine.eval([pending, *draft.tokens[:n_acc]], logits_at=[], seq=seq)
        t3 = time.perf_counter()
        self.observe(draft, emitted)
        t4 = time.perf_counter()

        st = self.stats
        st.rounds += 1
        st.emitted += len(emitted)
        st.drafted += len(draft.tokens)
        st.accepted += n_acc
        st.eval_seconds += t2 - t1
        st.lookup_seconds += (t1 - t0) + (t4 - t3)
        st.round_times.append(t4 - t0)
        self.cost.add(len(draft.tokens) + 1, t4 - t0)
        st.plain_seconds_per_token = self.cost.measured(1)
        return emitted

    def _verify(self, rows, draft: list[int], sampler: TokenSampler) -> list[int]:
        """Draw each position as plain decoding would; stop at the first draw that is not the draft."""
        base, n = self.index.tokens, len(self.index.tokens)
        out: list[int] = []
        for i in range(len(draft) + 1):
            tok = sampler.sample(rows[i], History(base, n, out))
            out.append(tok)
            if i == len(draft) or tok != draft[i]:
                break
        return out

    # ---- drafting (pure: no engine calls) -------------------------------------
    def propose(self, context: Sequence[int], pending: int, *, room: int | None = None,
                is_eos: Callable[[int], bool] | None = None) -> Draft:
        """The draft for history ``context + [pending]``: at most ``room`` tokens, none an end token."""
        self._sync(context, pending)
        idx = self.index
        if self._following >= 0:
            source, agreement = self._following, self._agreement
        else:
            source, agreement = idx.best_match(AcceptanceModel.MAX_AGREEMENT)
            if source < 0:
                return Draft([])
        k_max = self.draft_max if room is None else min(self.draft_max, room)
        tokens = idx.continuation(source, max(k_max, 0))
        if is_eos is not None:
            for i, t in enumerate(tokens):
                if is_eos(t):
                    del tokens[i:]
                    break
        if self.adaptive and tokens:
            curve = self.cost.curve()
            if curve is None:  # nothing measured yet: a plain round measures T(1)
                del tokens[:]
            else:
                del tokens[len(curve) - 1:]
                del tokens[choose_draft_length(self.acceptance.rates(agreement, len(tokens)), curve):]
        return Draft(tokens, source, agreement)

    def observe(self, draft: Draft, emitted: Sequence[int]) -> None:
        """Learn from a verified round and append the emitted tokens to the history.

        A round without drafts still tells whether the first draft token would
        have been accepted, which keeps the estimate alive when drafting stops.
        """
        if draft.source >= 0:
            tried = min(len(emitted), len(draft.tokens)) if draft.tokens else 1
            predicted = self.index.continuation(draft.source, len(emitted))
            kept = 0
            while kept < len(emitted) and predicted[kept] == emitted[kept]:
                kept += 1
            self.acceptance.observe(draft.agreement, tried, min(kept, tried))
            if kept == len(emitted):  # the source predicted the whole round: the copy goes on
                self._following = draft.source + len(emitted)
                self._agreement = min(draft.agreement + len(emitted), AcceptanceModel.MAX_AGREEMENT)
            else:
                self._following = -1
        else:
            self._following = -1
        self.index.extend(emitted)

    def _sync(self, context: Sequence[int], pending: int) -> None:
        """Make the index hold exactly context + [pending] (rebuilt if the caller rewound or switched)."""
        toks, size = self.index.tokens, len(context) + 1
        have = len(toks)
        tail = min(have, 8)
        if have <= size and all(toks[i] == (context[i] if i < size - 1 else pending) for i in range(have - tail, have)):
            if have < size:
                self.index.extend(context[have:])
                self.index.extend([pending])
            return
        self.index = NgramIndex(self.ngram_min, self.ngram_max, [*context, pending])
        self._following = -1
