"""A backend of your own behind the engine contract: a byte-level bigram model in numpy.

Anything that implements ``localinfer.backends.engine.Engine`` (tokenize, token_bytes,
kv_len, _trim, _eval_chunk, memory) gets the runner, sampling, stop strings,
prompt-lookup decoding and the ``run``/``chat``/``bench`` commands for free.
Register it by name in code (below), or for a package through the entry-point
group ``localinfer.backends`` in its pyproject.toml::

    [project.entry-points."localinfer.backends"]
    bigram = "mypackage.engine:BigramEngine"

    python examples/custom_backend.py
"""

from __future__ import annotations

import itertools

import numpy as np

from localinfer.backends import registry as backends
from localinfer.backends.engine import Engine, LoadPlan
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams

EOS = 256
CORPUS = ("the cat sat on the mat. the dog sat on the log. a bird sang in the tree. "
          "the sun rose over the hill and the day began. ") * 4


class BigramEngine(Engine):
    """P(next byte | this byte), counted from a corpus; the "KV cache" is the token list."""

    name = "bigram"

    def __init__(self, plan: LoadPlan):
        super().__init__(plan)
        data = plan.options.get("corpus", CORPUS).encode()
        counts = np.full((EOS + 1, EOS + 1), 0.01)
        for a, b in itertools.pairwise(data):
            counts[a, b] += 1
        counts[ord("."), EOS] += 2  # sentences may end the reply
        self.table = np.log(counts / counts.sum(axis=1, keepdims=True)).astype(np.float32)
        self.n_vocab, self.bos_id, self.eos_ids, self.add_bos = EOS + 1, None, frozenset({EOS}), False
        self._cache: dict[int, list[int]] = {s: [] for s in range(plan.n_seq)}

    def tokenize(self, text, *, add_bos=False, special=False):
        return list(text.encode("utf-8"))

    def token_bytes(self, token):
        return b"" if token == EOS else bytes([token])

    def kv_len(self, seq=0):
        return len(self._cache[seq])

    def _trim(self, n, seq):
        del self._cache[seq][n:]

    def _eval_chunk(self, tokens, start, logits_at, seq):
        self._cache[seq].extend(tokens)
        return self.table[[tokens[i] for i in logits_at]] if logits_at else None

    def memory(self):
        return {"weights": self.table.nbytes, "kv": 4 * sum(map(len, self._cache.values())), "compute": 0}


def main() -> None:
    backends.register("bigram", BigramEngine)
    engine = backends.load_engine(LoadPlan("bigram.model", n_ctx=512), "bigram")
    runner = Runner(engine)
    for chunk in runner.stream(engine.tokenize("the "), SamplingParams(temperature=0.8, seed=1), max_tokens=80,
                               stop=["\n"]):
        print(chunk.text, end="", flush=True)
    print(f"\n[{chunk.timings.generated} tokens, finish: {chunk.finish_reason}]")
    # The same engine through the CLI (the MODEL argument is only used for the fit check it skips):
    from localinfer.cli import main as cli

    cli(["run", "--backend", "bigram", "--raw", "-p", "a bird ", "-n", "40", "--seed", "3"])


if __name__ == "__main__":
    main()
