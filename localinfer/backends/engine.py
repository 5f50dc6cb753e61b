"""The engine contract every backend implements (llama.cpp, torch, mlx).

An engine owns one loaded model and its KV cache for ``n_seq`` sequences.  It
does exactly four things the runner needs, and nothing about sampling:

* tokenize / detokenize (special-token text is parsed only when asked, i.e.
  for chat-template pieces, never for user text);
* ``eval(tokens, logits_at)``: append tokens to a sequence's KV cache and
  return logits only at the requested positions;
* ``kv_len(seq)`` and ``trim(n, seq)``: how many tokens are cached, and rewind
  to n tokens (what makes speculative decoding backend-agnostic);
* ``memory()`` and ``close()``.

Long evaluations run in chunks of ``plan.n_batch`` tokens; a KeyboardInterrupt
between chunks rolls the cache back to where the call started and re-raises.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from localinfer.errors import ContextFullError, UsageError
from localinfer.model.kv import KV_TYPES

if TYPE_CHECKING:
    import numpy as np

    from localinfer.model.spec import ModelSpec


@dataclass(frozen=True)
class LoadPlan:
    """How to load a model; ``localinfer fit`` produces one, flags can override it."""

    model_path: str
    n_ctx: int = 4096
    n_seq: int = 1                 # sequences with their own KV (parallel requests)
    n_gpu_layers: int = -1         # -1: all layers on the accelerator (if any)
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool | None = None  # None: backend decides (on when V is quantized)
    n_batch: int = 512             # tokens per eval chunk
    n_ubatch: int = 512            # tokens per compute graph
    n_threads: int | None = None
    seed: int = 0
    device: str | None = None      # backend-specific: "cuda", "cpu", "gpu"...
    dtype: str | None = None       # backend-specific weight dtype ("bf16", "f32")
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.n_ctx, int) or self.n_ctx <= 0:
            raise UsageError(f"context size must be a positive integer, got {self.n_ctx!r}", flag="--ctx")
        if self.n_seq <= 0:
            raise UsageError(f"parallel sequences must be >= 1, got {self.n_seq}", flag="--parallel")
        for flag, t in (("-ctk", self.type_k), ("-ctv", self.type_v)):
            if t not in KV_TYPES:
                raise UsageError(f"unknown KV type {t!r}", flag=flag, hint="use one of " + ", ".join(KV_TYPES))
        if self.n_batch <= 0 or self.n_ubatch <= 0:
            raise UsageError("batch sizes must be positive", flag="--batch")

    def with_(self, **changes) -> "LoadPlan":
        return replace(self, **changes)

    @property
    def threads(self) -> int:
        return self.n_threads or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class Engine(ABC):
    """Base class of backends.  Subclasses implement the ``_``-prefixed primitives."""

    #: registry name, e.g. "llama.cpp"
    name: str = "abstract"

    def __init__(self, plan: LoadPlan):
        self.plan = plan
        self.n_ctx = plan.n_ctx
        self.n_seq = plan.n_seq

    # ---- model facts (set by subclasses) -----------------------------------
    n_vocab: int
    bos_id: int | None
    eos_ids: frozenset[int]
    spec: ModelSpec | None = None   # the GGUF header's facts, where the backend read one
    #: ``embedder(n_ctx, n_seq)`` gives an embeddings context (``serve``'s /v1/embeddings)
    embeds: bool = False
    #: ``trim(n)`` with 0 < n < kv_len can cut a sequence's tail (False: a recurrent or hybrid model, whose state
    #: cannot go back a token; only ``trim(0)`` clears it)
    trims_tail: bool = True

    # ---- tokenizer ---------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of text.  ``special=True`` parses special-token text such as
        ``<|im_start|>``; use it only for chat-template pieces, never user text."""

    @abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """The bytes one token contributes to the output (may be a partial UTF-8 sequence)."""

    def longest_token_bytes(self) -> int:
        """Bytes of the longest vocabulary token, output or special text (computed once)."""
        n = getattr(self, "_longest_token", None)
        if n is None:
            n = max((max(len(self.token_bytes(t)), len(self.token_text(t).encode("utf-8", "replace")))
                     for t in range(self.n_vocab)), default=1)
            n = self._longest_token = max(n, 1)
        return n

    def check_text_fits(self, n_bytes: int, what: str = "the prompt") -> None:
        """Refuse, before tokenizing, text that cannot fit in the context (ContextFullError).

        No token stands for more than :meth:`longest_token_bytes` bytes, so ``n_bytes`` of text
        are at least ``n_bytes / longest`` tokens; text of at most ``n_ctx`` bytes is never refused.
        """
        if n_bytes <= self.n_ctx:
            return
        least = -(-n_bytes // self.longest_token_bytes())
        if least >= self.n_ctx:
            raise ContextFullError(f"{what} is {n_bytes:,} bytes, so at least {least:,} tokens; "
                                   f"the context holds {self.n_ctx}", needed=least, available=self.n_ctx,
                                   hint="use a larger --ctx or a shorter prompt")

    def token_text(self, token: int) -> str:
        """A token's vocabulary text, special tokens included (for chat templates and display).

        The default decodes the token's output bytes; engines with a vocabulary override it."""
        return self.detokenize([token])

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eos(self, token: int) -> bool:
        return token in self.eos_ids

    # ---- KV cache ----------------------------------------------------------
    @abstractmethod
    def kv_len(self, seq: int = 0) -> int:
        """Tokens currently cached for sequence seq."""

    @abstractmethod
    def _trim(self, n: int, seq: int) -> None:
        """Drop cached positions >= n of sequence seq."""

    def snapshot(self, seq: int = 0):
        """Sequence seq's recurrent state at the tokens it holds, saved to host memory (a
        :class:`~localinfer.backends.executor.SeqState`), for an engine that does not ``trims_tail``."""
        raise NotImplementedError(f"the {self.name} engine holds no recurrent state to snapshot")

    def rewind(self, state, seq: int = 0) -> None:
        """Sequence seq back to ``state.n_tokens`` tokens: its recurrent state restored from ``state`` (taken of the
        same tokens by :meth:`snapshot`), every position from there dropped."""
        raise NotImplementedError(f"the {self.name} engine holds no recurrent state to rewind")

    def trim(self, n: int, seq: int = 0) -> None:
        """Rewind sequence seq to its first n tokens (0 clears it)."""
        cur = self.kv_len(seq)
        if n < 0 or n > cur:
            raise ValueError(f"cannot trim sequence {seq} to {n} tokens; it holds {cur}")
        if n < cur:
            self._trim(n, seq)

    # ---- evaluation --------------------------------------------------------
    @abstractmethod
    def _eval_chunk(self, tokens: Sequence[int], start: int, logits_at: Sequence[int], seq: int) -> np.ndarray | None:
        """Append tokens at positions start.. to seq; return float32 logits
        [len(logits_at), n_vocab] for the given indices into this chunk (or None if empty).

        The array is handed to the caller as is for a one-token decode step, so it
        must not be storage the backend overwrites later."""

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int] | None = None, *, seq: int = 0) -> np.ndarray:
        """Append tokens to sequence seq and return logits at the requested indices.

        ``logits_at`` indexes ``tokens`` (negative indices allowed) and defaults
        to ``[-1]``; pass ``[]`` to get no logits (cheap prompt prefill).
        Returns float32 of shape [len(logits_at), n_vocab] in the order asked.
        One token with the default logits (the decode step) goes straight to
        ``_eval_chunk``: same checks and rollback, no chunking or reordering.
        """
        import numpy as np      # here, not at the top: `fit` and `plan` import this module and need no numpy

        n = len(tokens)
        if n == 0:
            raise ValueError("eval needs at least one token")
        start = self.kv_len(seq)
        if start + n > self.n_ctx:
            raise ContextFullError(
                f"{start + n} tokens do not fit in the context of {self.n_ctx}",
                needed=start + n, available=self.n_ctx,
                hint="use a larger --ctx, a shorter prompt, or start a new conversation",
            )
        if n == 1 and (logits_at is None or list(logits_at) in ([0], [-1])):
            try:
                return np.asarray(self._eval_chunk(tokens, start, [0], seq), dtype=np.float32)
            except BaseException:
                self._rollback(start, seq)
                raise
        want = [i + n if i < 0 else i for i in ([-1] if logits_at is None else logits_at)]
        if any(not 0 <= i < n for i in want):
            raise ValueError(f"logits_at {logits_at} outside 0..{n - 1}")
        out = np.empty((len(want), self.n_vocab), dtype=np.float32)
        order = sorted(range(len(want)), key=lambda j: want[j])
        step = self.plan.n_batch
        try:
            k = 0
            for c0 in range(0, n, step):
                c1 = min(n, c0 + step)
                local: list[int] = []
                rows: list[int] = []
                while k < len(order) and want[order[k]] < c1:
                    local.append(want[order[k]] - c0)
                    rows.append(order[k])
                    k += 1
                res = self._eval_chunk(tokens[c0:c1], start + c0, local, seq)
                if rows:
                    out[rows] = res
        except BaseException:
            self._rollback(start, seq)
            raise
        return out

    def _rollback(self, start: int, seq: int) -> None:
        """After an interrupted or failed eval: leave the cache as it was before it (an engine that cannot trim a
        tail clears the sequence: its recurrent state went past ``start``, and the next prompt is computed again)."""
        if self.kv_len(seq) > start:
            self._trim(start if self.trims_tail else 0, seq)

    def eval_batch(self, steps: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Append tokens to several sequences at once; logits of each sequence's last token.

        The default runs them one after another; backends override it to run
        one batched forward (used for batch-scaling measurements).
        """
        return {seq: self.eval(toks, seq=seq)[0] for seq, toks in steps.items()}

    # ---- resources ---------------------------------------------------------
    @abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes in use by kind: at least ``weights`` and ``kv``; ``compute`` if known."""

    def close(self) -> None:
        """Free the model and cache.  Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {os.path.basename(self.plan.model_path)} ctx={self.n_ctx}>"
