"""What speculative decoding buys: tokens per round, time per token, break-evens.

A round drafts ``k`` tokens, verifies ``k + 1`` positions in one target step and
keeps E[N] = 1 + Σ_j Π_{i≤j} a_i tokens on average.  Time per token is
Σ T_r / Σ N_r (never the mean of per-round ratios).  A draft is worth making
longer only while ΔT/ΔN < T/N; verified rows padded up to a captured graph
shape make ΔT jump.  ``Drafting`` describes a draft source (context lookup or a
draft model) in the terms the planner needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from localinfer.errors import UsageError

__all__ = [
    "GRAPH_SHAPES",
    "MAX_DRAFT",
    "DraftRow",
    "Drafting",
    "acceptances",
    "choose_draft_length",
    "clairvoyant_speedup",
    "clairvoyant_time",
    "copy_runs",
    "draft_forward_s",
    "draft_length_table",
    "expected_tokens",
    "lookup_break_even",
    "mean_token_time",
    "padded_rows",
    "payback_tokens",
    "worth_lengthening",
]

GRAPH_SHAPES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


MAX_DRAFT = 256  # also the longest n-gram; a round verifies at most MAX_DRAFT + 1 tokens


def expected_tokens(acceptance: Sequence[float]) -> float:
    """E[N] for a draft of len(acceptance) tokens: 1 + Σ_j Π_{i<=j} a_i."""
    total, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        total += run
    return total


def choose_draft_length(acceptance: Sequence[float], cost: Callable[[int], float] | Sequence[float],
                        lengths: Sequence[int] | None = None) -> int:
    """The draft length with the least time per emitted token, T_m / E[N_m].

    ``acceptance[j-1]`` is a_j, the chance that draft token j is accepted when
    all before it were; ``cost(m)`` (or ``cost[m]``) is the time of a round with
    m drafts.  Starting from no draft, the draft is lengthened to m only while
    ΔT/ΔN < T/N against the best length so far, which is the marginal rule of
    docs/speculation.md, applied across cost jumps (padding to graph shapes) as well.
    """
    t_of = cost if callable(cost) else cost.__getitem__
    candidates = range(len(acceptance) + 1) if lengths is None else sorted({0, *lengths})
    best_m, best_t, best_n = 0, t_of(0), 1.0
    n_m, run, j = 1.0, 1.0, 0
    for m in candidates:
        if m == 0 or m > len(acceptance):
            continue
        while j < m:
            run *= acceptance[j]
            n_m += run
            j += 1
        t_m = t_of(m)
        if (t_m - best_t) * best_n < (n_m - best_n) * best_t:
            best_m, best_t, best_n = m, t_m, n_m
    return best_m


def copy_runs(history: Sequence[int], output: Sequence[int], cap: int = MAX_DRAFT) -> list[int]:
    """For each position i of ``output``, the longest run ``output[i:i + L]`` (L <= cap) that a drafter
    copying from the text so far could propose there: its source starts before position i of
    ``history + output`` and may run on into the tokens the copy itself produces (periodic text)."""
    seq = [*history, *output]
    where: dict[int, list[int]] = {}
    for p, t in enumerate(history):
        where.setdefault(t, []).append(p)
    runs = []
    for i, first in enumerate(output):
        n = len(history) + i
        want = min(cap, len(output) - i)
        best = 0
        for p in where.get(first, ()):
            length = 1
            while length < want and seq[p + length] == seq[n + length]:
                length += 1
            best = max(best, length)
            if best == want:
                break
        runs.append(best)
        where.setdefault(first, []).append(n)
    return runs


def clairvoyant_time(history: Sequence[int], output: Sequence[int], cost: Sequence[float]) -> tuple[float, int]:
    """(time, rounds): the least verify time in which any copying drafter could emit ``output``.

    The drafter knows in advance how long each copy will hold, so it drafts
    exactly the tokens that will be accepted, as many per round as pays off:
    ``cost[m - 1]`` is the time of a round that verifies m tokens (pending +
    m - 1 drafts) and emits m.  No prompt-lookup policy can beat this on the
    same engine, which makes ``len(output) * cost[0] / time`` the ceiling of
    its speedup for that output.
    """
    runs = copy_runs(history, output, cap=len(cost) - 1)
    n = len(output)
    best = [(0.0, 0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min((cost[k] + best[i + k + 1][0], best[i + k + 1][1] + 1)
                      for k in range(min(runs[i], n - 1 - i) + 1))
    return best[0]


def clairvoyant_speedup(history: Sequence[int], output: Sequence[int], cost: Sequence[float]) -> float:
    """The clairvoyant drafter's speedup over plain decoding (``cost[0]`` a token) on ``output``."""
    time, _ = clairvoyant_time(history, output, cost)
    return len(output) * cost[0] / time


def acceptances(a: float | Sequence[float], k: int | None = None) -> list[float]:
    """Per-position acceptance a_1..a_k: a constant ``a`` repeated k times, or the list as given."""
    if isinstance(a, (int, float)):
        if not 0 <= a <= 1 or k is None or k < 0:
            raise UsageError(f"acceptance must be between 0 and 1 (got {a}) with a draft length >= 0",
                             flag="--acceptance")
        return [float(a)] * k
    seq = [float(x) for x in a]
    if any(not 0 <= x <= 1 for x in seq):
        raise UsageError("every acceptance must be between 0 and 1", flag="--acceptance")
    return seq[:k] if k is not None else seq


def mean_token_time(rounds: Iterable[tuple[float, int]]) -> float:
    """Σ T_r / Σ N_r over (round time, tokens kept) pairs."""
    total_t = total_n = 0
    for t, n in rounds:
        total_t += t
        total_n += n
    return total_t / total_n if total_n else math.inf


def lookup_break_even(plain_step_s: float, verify_s: float, expected: float) -> float:
    """Largest drafting time per round that still beats plain decoding: E[N]·T_plain − T_verify."""
    return expected * plain_step_s - verify_s


def payback_tokens(setup_s: float, plain_token_s: float, spec_token_s: float) -> int | None:
    """Tokens after which a one-off setup (e.g. an index build) has paid for itself."""
    saved = plain_token_s - spec_token_s
    return math.ceil(setup_s / saved) if saved > 0 else None


def padded_rows(rows: int, shapes: Sequence[int] = GRAPH_SHAPES) -> int:
    """Rows actually computed when ``rows`` are padded to the next captured graph shape."""
    for s in sorted(shapes):
        if s >= rows:
            return s
    return rows


def draft_forward_s(draft_bytes: int, effective_bandwidth: float) -> float:
    """One forward of a bandwidth-bound draft network: its weight bytes at the achieved bandwidth."""
    return draft_bytes / effective_bandwidth


@dataclass(frozen=True)
class DraftRow:
    """One draft length m: E[N_m], the round time T_m, and T_m / E[N_m]."""

    length: int
    expected: float
    round_s: float

    @property
    def per_token_s(self) -> float:
        return self.round_s / self.expected


def draft_length_table(acceptance: Sequence[float], round_s, lengths: Iterable[int]) -> list[DraftRow]:
    """E[N_m], T_m and T_m/E[N_m] for each draft length m (``round_s(m)`` gives T_m)."""
    return [DraftRow(m, expected_tokens(list(acceptance)[:m]), float(round_s(m))) for m in lengths]


def worth_lengthening(t: float, n: float, t_next: float, n_next: float) -> bool:
    """The marginal rule: lengthen only if ΔT/ΔN < T/N."""
    dn = n_next - n
    return dn > 0 and (t_next - t) / dn < t / n


@dataclass(frozen=True)
class Drafting:
    """A draft source as the planner sees it.

    ``expected`` tokens per round from ``draft_tokens`` drafts (``draft_tokens + 1``
    verified rows); ``round_extra_s`` drafting time added to each round;
    ``prefill_factor`` scales prefill (a draft model prefills too);
    ``memory_bytes`` device memory it holds; ``setup_s`` one-off work.
    """

    kind: str                     # "lookup" or "model"
    expected: float
    draft_tokens: int
    round_extra_s: float = 0.0
    prefill_factor: float = 1.0
    memory_bytes: int = 0
    setup_s: float = 0.0
    name: str = ""

    def __post_init__(self):
        if self.kind not in ("lookup", "model"):
            raise UsageError(f"unknown draft source {self.kind!r}; use 'lookup' or 'model'", flag="--draft")
        if not 1 <= self.expected <= self.draft_tokens + 1:
            raise UsageError(f"expected tokens per round {self.expected} must be between 1 and "
                             f"draft length + 1 = {self.draft_tokens + 1}", flag="--acceptance")

    @property
    def rows(self) -> int:
        return self.draft_tokens + 1

    @classmethod
    def lookup(cls, acceptance: float | Sequence[float], draft_tokens: int = 4, query_s: float = 1e-4,
               setup_s: float = 0.0) -> Drafting:
        """Context lookup (prompt lookup): drafts from an index in host memory, no device memory."""
        a = acceptances(acceptance, draft_tokens)
        return cls("lookup", expected_tokens(a), len(a), round_extra_s=query_s, setup_s=setup_s,
                   name="context lookup")

    @property
    def label(self) -> str:
        src = self.name or ("context lookup" if self.kind == "lookup" else "draft model")
        return f"{src}, E[N] = {self.expected:.2f}"


def model_drafting(draft_cost, target, workload, acceptance: float | Sequence[float], draft_tokens: int = 4, *,
                   parallel: bool = False, kv="f16", name: str = "") -> Drafting:
    """A draft model on the target's device: its weights and KV in memory, its prefill, its forwards.

    ``target`` is the target's SpeedModel; the draft runs ``draft_tokens``
    forwards per round (one when ``parallel``, as DFlash-style drafters do).
    """
    from localinfer.plan.speed import SpeedModel

    ds = SpeedModel(draft_cost, target.device)
    w = workload
    fwd = ds.decode_step(w.requests, w.decode_context, kv).seconds
    new, cached = w.input_tokens - w.cached_tokens, w.cached_tokens
    extra = ds.prefill(w.requests, new, cached).seconds / target.prefill(w.requests, new, cached).seconds
    held = w.input_tokens + w.output_tokens + draft_tokens
    memory = draft_cost.weight_bytes + w.requests * draft_cost.kv_read_bytes(held, kv)
    a = acceptances(acceptance, draft_tokens)
    return Drafting("model", expected_tokens(a), len(a), round_extra_s=fwd * (1 if parallel else len(a)),
                    prefill_factor=1 + extra, memory_bytes=memory, name=name or draft_cost.name)
