"""Paged KV arithmetic: blocks of ``p`` tokens, block tables, shared prefixes, how many requests a budget holds.

A sequence of ``L`` tokens takes ⌈L / p⌉ blocks (``blocks_for``; the block size
``DEFAULT_BLOCK_TOKENS`` is defined in ``localinfer.model.kv``, where the torch
backend reads it too, and re-exported here); a prefix common to several
sequences is stored once, as far as its whole blocks go.  The serving engine's
block manager and the planner both count with these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.errors import UsageError
from localinfer.model.kv import DEFAULT_BLOCK_TOKENS, blocks_for, kv_bytes_per_token
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to

# DEFAULT_BLOCK_TOKENS and blocks_for live in localinfer.model.kv (backends count in them too) and are
# importable from here as before.


def tokens_held(n_input: int, n_output: int) -> int:
    """Tokens a finished request keeps in KV: input + output − 1 (the last token is never written back)."""
    if n_input < 0 or n_output < 0:
        raise UsageError("input and output lengths must be non-negative", flag="--ctx")
    return n_input + max(n_output - 1, 0)


@dataclass(frozen=True)
class PageUsage:
    block_tokens: int
    blocks: int            # block-table entries = physical blocks without sharing
    slots: int             # token slots reserved
    used: int              # token slots holding tokens
    physical_blocks: int   # after sharing common prefix blocks

    @property
    def unused(self) -> int:
        return self.slots - self.used


def page_usage(lengths: list[int], block_tokens: int, shared_prefix: int = 0, sharing: list[int] | None = None
               ) -> PageUsage:
    """Blocks, slots and waste when sequences of these lengths are paged in blocks of ``block_tokens``.

    ``shared_prefix`` tokens are common to the sequences listed in ``sharing``
    (indices; all by default); only its whole blocks are shared.
    """
    if block_tokens <= 0:
        raise UsageError("block size must be positive", flag="--block")
    blocks = sum(blocks_for(n, block_tokens) for n in lengths)
    share = list(range(len(lengths))) if sharing is None else sharing
    shared_blocks = min(shared_prefix, *(lengths[i] for i in share)) // block_tokens if share else 0
    saved = shared_blocks * max(len(share) - 1, 0)
    return PageUsage(block_tokens, blocks, blocks * block_tokens, sum(lengths), blocks - saved)


@dataclass(frozen=True)
class SharedPrefixKV:
    prefix_bytes: int        # the common prefix's whole blocks, stored once
    private_bytes: int       # per sequence, its own blocks
    n_seq: int

    @property
    def total(self) -> int:
        return self.prefix_bytes + self.n_seq * self.private_bytes

    def max_sequences(self, budget_bytes: int) -> int:
        """How many sequences fit in budget_bytes next to one copy of the prefix."""
        if self.private_bytes <= 0:
            return 0
        return max(0, (budget_bytes - self.prefix_bytes) // self.private_bytes)


def shared_prefix_kv(spec: ModelSpec, prefix_tokens: int, tokens_per_seq: int, n_seq: int = 1,
                     type_k: str = "f16", type_v: str = "f16", *,
                     block_tokens: int = DEFAULT_BLOCK_TOKENS) -> SharedPrefixKV:
    """KV with a common prefix stored once (whole blocks) and the rest per sequence (paged).

    16 Qwen3-8B requests of 8447 tokens sharing 6144: 864 + 16 × 324 = 6048 MiB.
    """
    if not 0 <= prefix_tokens <= tokens_per_seq:
        raise UsageError(f"shared prefix {prefix_tokens} must be between 0 and the request length "
                         f"{tokens_per_seq}", flag="--shared-prefix")
    per_token = kv_bytes_per_token(spec, type_k, type_v)
    shared = prefix_tokens // block_tokens * block_tokens
    private = pad_to(tokens_per_seq - shared, block_tokens)
    return SharedPrefixKV(shared * per_token, private * per_token, n_seq)


def max_sequences(budget_bytes: int, bytes_per_seq: int, fixed_bytes: int = 0) -> int:
    """⌊(budget − fixed) / per-sequence⌋, never negative: 12 GiB / 324 MiB → 37."""
    if bytes_per_seq <= 0:
        raise ValueError("bytes_per_seq must be positive")
    return max(0, (budget_bytes - fixed_bytes) // bytes_per_seq)



def block_bytes(bytes_per_token: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Bytes of one KV block: p · k (p tokens of k bytes each)."""
    if block_tokens <= 0:
        raise UsageError("block size must be positive", flag="--block")
    return block_tokens * bytes_per_token


def blocks_in_budget(budget_bytes: int, bytes_per_token: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Whole KV blocks a budget holds: ⌊budget / (p · k)⌋ (12 GiB at 144 KiB/token, p = 16 → 5461)."""
    return max_sequences(budget_bytes, block_bytes(bytes_per_token, block_tokens))


def request_blocks(n_input: int, n_output: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, cached_tokens: int = 0
                   ) -> int:
    """Blocks a request reserves at admission: ⌈(input + output − 1) / p⌉ less the whole cached prefix blocks."""
    return blocks_for(tokens_held(n_input, n_output), block_tokens) - cached_tokens // block_tokens
