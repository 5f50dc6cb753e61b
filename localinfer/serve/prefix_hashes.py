"""The chain hashes that name whole KV blocks: ``h_i = H(h_{i-1}, tokens of block i)``, and a per-sequence memo.

Equal hashes mean equal prefixes (the block manager checks every hit against the stored parent hash and
tokens, so a collision is a miss, never wrong KV).
"""

from __future__ import annotations


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """H(parent hash, tokens): the default block hash."""
    return hash((parent, tokens))


class PrefixHashes:
    """The chain hashes of a sequence's leading whole blocks, each computed once (a memo for one sequence).

    The sequence may only grow at its end (a request's prompt + outputs): a whole block
    never changes then, so its hash stays valid.  ``truncate`` drops the hashes past a
    shorter sequence; a manager with another block size or hash function starts over.
    """

    __slots__ = ("_key", "values")

    def __init__(self):
        self.values: list[int] = []
        self._key: tuple | None = None

    def truncate(self, n_tokens: int, block_tokens: int) -> None:
        """Keep only the hashes of blocks wholly inside the first ``n_tokens``."""
        del self.values[n_tokens // block_tokens:]

    def _for(self, key: tuple) -> PrefixHashes:
        if self._key != key:
            self.values.clear()
            self._key = key
        return self
