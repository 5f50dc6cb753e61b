"""A serving request: what it asks for, where it is in its life, and when each token came.

States, and the transitions that move between them::

    waiting ──admit()──▶ running ──finish()──▶ finished (stop | length | cancelled | deadline | error)
       ▲                    │
       └──── preempt() ◀────┘   (its KV is dropped and recomputed on readmission; ``preemptions`` counts it)

A waiting request may also finish (cancelled, refused at admission, past its deadline).

The tokens still to compute are ``all_tokens[computed:]``: after a preemption
``computed`` is 0 and the prompt *and* the outputs so far are prefilled again;
the step that computes the last of them yields the next output token.  A request
with G outputs therefore needs one prefill (yielding output 1) and G − 1 decode
steps, and holds input + G − 1 tokens of KV when it finishes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from localinfer.errors import UsageError
from localinfer.generation.sampling import Sampler, SamplingParams, check_max_tokens
from localinfer.serve.prefix_hashes import PrefixHashes


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


GREEDY = SamplingParams(temperature=0.0, seed=0)


@dataclass(eq=False)
class Request:
    """One request.  Times are seconds on the executor's clock; ``deadline_s`` is absolute on it."""

    id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0
    deadline_s: float | None = None
    sampling: SamplingParams = GREEDY
    stop: tuple[tuple[int, ...], ...] = ()     # token sequences that end the output (kept in it)
    stop_tokens: frozenset[int] = frozenset()  # e.g. the model's end-of-generation ids

    state: State = field(default=State.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    output: list[int] = field(default_factory=list, init=False)
    token_times: list[float] = field(default_factory=list, init=False)
    computed: int = field(default=0, init=False)       # tokens of all_tokens held in KV
    cached: int = field(default=0, init=False)         # of those, found in the prefix cache at admission
    past_snapshot: int = field(default=0, init=False)  # matched past the deepest snapshot (recurrent: recomputed)
    admitted_s: float | None = field(default=None, init=False)
    finished_s: float | None = field(default=None, init=False)
    preemptions: int = field(default=0, init=False)
    recomputed: int = field(default=0, init=False)     # tokens computed again after preemptions
    dropped: int = field(default=0, init=False)        # tokens whose KV the last preemption dropped
    seq: int = field(default=-1, init=False)           # admission number: lower is older

    def __post_init__(self):
        self.prompt = tuple(int(t) for t in self.prompt)
        if not self.prompt:
            raise UsageError(f"request {self.id!r}: the prompt is empty", hint="give at least one input token")
        check_max_tokens(self.max_tokens)
        if self.deadline_s is not None and self.deadline_s < self.arrival_s:
            raise UsageError(f"request {self.id!r}: deadline {self.deadline_s} is before arrival {self.arrival_s}",
                             hint="deadline_ms must be at or after arrival_ms")
        self.stop = tuple(tuple(int(t) for t in s) for s in self.stop if len(s))
        self._sampler: Sampler | None = None
        self._hashes = PrefixHashes()
        self._hashed = (self.prompt, 0)    # the prompt and output count the hashes were last handed out for

    # ---- derived -------------------------------------------------------------
    @property
    def all_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    def view(self, n: int | None = None) -> TokenView:
        """The first n of all_tokens (all by default) without copying them."""
        return TokenView(self, self.n_tokens if n is None else n)

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next output token."""
        return self.n_tokens - self.computed

    @property
    def prefilling(self) -> bool:
        """More than one token to compute: a prompt (or a recompute) in progress."""
        return self.remaining > 1 or not self.output

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft_s(self) -> float | None:
        return None if not self.token_times else self.token_times[0] - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token latencies: the time between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in pairwise(t)]

    @property
    def max_gap_s(self) -> float:
        return max(self.gaps_s, default=0.0)

    @property
    def on_time(self) -> bool:
        """Finished with its whole output (stop or length) by its deadline (or it has none)."""
        done = self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        return done and (self.deadline_s is None or self.finished_s <= self.deadline_s + 1e-12)

    @property
    def sampler(self) -> Sampler:
        """This request's own sampler, seeded from its SamplingParams."""
        if self._sampler is None:
            self._sampler = Sampler(self.sampling)
        return self._sampler

    def prefix_hashes(self, block_tokens: int) -> PrefixHashes:
        """The block hashes of ``all_tokens``, kept across steps and preemptions (outputs only append).

        A new prompt starts them over; fewer outputs than before drop the hashes past them.
        """
        prompt, n_out = self._hashed
        if prompt is not self.prompt:
            self._hashes = PrefixHashes()
        elif len(self.output) < n_out:
            self._hashes.truncate(self.n_tokens, block_tokens)
        self._hashed = (self.prompt, len(self.output))
        return self._hashes

    # ---- transitions ---------------------------------------------------------
    def append(self, token: int, now: float) -> FinishReason | None:
        """Record an output token made at ``now``; the reason if it ends the request."""
        self.output.append(int(token))
        self.token_times.append(now)
        if token in self.stop_tokens or any(_ends_with(self.output, s) for s in self.stop):
            return FinishReason.STOP
        if len(self.output) >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def admit(self, cached: int, seq: int, now: float, past_snapshot: int = 0) -> None:
        """Admitted at ``now`` as the ``seq``-th, with its first ``cached`` tokens' KV found in the prefix cache
        (and ``past_snapshot`` more matched there that a recurrent state cannot reach: computed again)."""
        self.cached = self.computed = cached
        self.past_snapshot = past_snapshot
        self.recomputed += max(0, self.dropped - cached)    # what the prefix cache did not keep
        self.dropped = 0
        self.state = State.RUNNING
        self.seq = seq
        if self.admitted_s is None:
            self.admitted_s = now

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> None:
        """Finished (the scheduler's ``finish`` is the one caller): a subclass releases what it holds here."""
        self.state = State.FINISHED
        self.finish_reason = reason
        self.finished_s = now
        self.error = error

    def preempt(self) -> None:
        """Drop the KV (recompute on readmission): back to waiting, nothing computed."""
        self.preemptions += 1
        self.dropped = self.computed
        self.computed = 0
        self.cached = 0
        self.state = State.WAITING


class TokenView(Sequence[int]):
    """prompt + output, first ``n`` tokens; slicing copies only the slice."""

    def __init__(self, request: Request, n: int):
        self.r, self.n = request, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(self.n)
            p = len(self.r.prompt)
            if step != 1:
                return tuple(self[k] for k in range(a, b, step))
            return self.r.prompt[a:min(b, p)] + tuple(self.r.output[max(a - p, 0):max(b - p, 0)])
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        p = len(self.r.prompt)
        return self.r.prompt[i] if i < p else self.r.output[i - p]


def _ends_with(output: Sequence[int], stop: Sequence[int]) -> bool:
    return len(output) >= len(stop) and tuple(output[-len(stop):]) == tuple(stop)
