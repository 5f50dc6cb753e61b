"""Test doubles shared by the test folders: real Engine subclasses and samplers that need no model file.

``ScriptedEngine`` is a real :class:`localinfer.backends.engine.Engine` whose next-token
logits are a function of the tokens so far; ``TableSampler`` is temperature sampling with
its own seeded RNG (the Sampler protocol).
"""

import numpy as np

from localinfer.backends.engine import Engine, LoadPlan


class ScriptedEngine(Engine):
    """An engine whose logits for the next token are ``logits_fn(tokens_so_far)``."""

    name = "scripted"

    def __init__(self, logits_fn, n_vocab: int, n_ctx: int = 4096, eos: int | None = None):
        super().__init__(LoadPlan(model_path="scripted", n_ctx=n_ctx, n_batch=64))
        self.logits_fn = logits_fn
        self.n_vocab = n_vocab
        self.bos_id = None
        self.eos_ids = frozenset() if eos is None else frozenset({eos})
        self.kv: list[int] = []
        self.evals: list[int] = []

    def tokenize(self, text, *, add_bos=False, special=False):
        return [int(t) for t in text.split()]

    def token_bytes(self, token):
        return f"{token} ".encode()

    def kv_len(self, seq=0):
        return len(self.kv)

    def _trim(self, n, seq):
        del self.kv[n:]

    def _eval_chunk(self, tokens, start, logits_at, seq):
        assert start == len(self.kv)
        self.kv.extend(tokens)
        self.evals.append(list(tokens))
        if not logits_at:
            return None
        return np.stack([self.logits_fn(self.kv[:start + i + 1]) for i in logits_at]).astype(np.float32)

    def memory(self):
        return {"weights": 0, "kv": len(self.kv)}


class TableSampler:
    """Temperature sampling with its own seeded RNG (the Sampler protocol)."""

    constraint = None

    def __init__(self, temperature: float = 1.0, seed: int = 0):
        self.greedy = temperature == 0
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)

    def probs(self, logits, history):
        if self.greedy:
            p = np.zeros(len(logits))
            p[int(np.argmax(logits))] = 1.0
            return p
        z = np.asarray(logits, dtype=np.float64) / self.temperature
        e = np.exp(z - z.max())
        return e / e.sum()

    def sample_from(self, probs):
        return int(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right").clip(0, len(probs) - 1))

    def sample(self, logits, history):
        if self.greedy:
            return int(np.argmax(logits))
        return self.sample_from(self.probs(logits, history))


def bigram_table(n_vocab: int, seed: int, sharp: float = 1.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, sharp, size=(n_vocab, n_vocab))
