"""Sentence embeddings with llama.cpp's pooling, on a context of their own over an already loaded model.

The context is made with ``embeddings`` on and the pooling type the GGUF names
(``{arch}.pooling_type``); a model that names none (a generative model) is
mean-pooled over its last hidden states.  Several inputs share one
``llama_decode`` as separate sequences; each vector is L2-normalised, as
OpenAI's and llama-server's are.  The generation context is never touched:
the embeddings context has its own KV cells, cleared after every batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp as _L
import numpy as np

from localinfer.backends.llamacpp import native
from localinfer.errors import LocalinferError, UnsupportedModelError

POOLING = {_L.LLAMA_POOLING_TYPE_MEAN: "mean", _L.LLAMA_POOLING_TYPE_CLS: "cls", _L.LLAMA_POOLING_TYPE_LAST: "last"}


class LlamaEmbedder:
    """Embeddings of token sequences of at most ``n_ctx`` tokens, up to ``n_seq`` of them per decode."""

    def __init__(self, model, n_ctx: int, n_seq: int = 8, threads: int = 1):
        self.model, self.n_ctx, self.n_seq = model, int(n_ctx), int(n_seq)
        self.n_embd = int(_L.llama_model_n_embd(model))
        self._ctx = self._new(_L.LLAMA_POOLING_TYPE_UNSPECIFIED, threads)
        pooling = int(_L.llama_pooling_type(self._ctx))
        if pooling == _L.LLAMA_POOLING_TYPE_NONE:           # the GGUF names none: mean over the hidden states
            _L.llama_free(self._ctx)
            self._ctx = self._new(_L.LLAMA_POOLING_TYPE_MEAN, threads)
            pooling = int(_L.llama_pooling_type(self._ctx))
        if pooling not in POOLING:
            self.close()
            raise UnsupportedModelError(f"this model's pooling type ({pooling}) does not make embeddings",
                                        hint="a reranker scores pairs; use an embedding or generative model")
        self.pooling = POOLING[pooling]
        self._mem = _L.llama_get_memory(self._ctx)
        self._batch = _L.llama_batch_init(self.n_ctx, 0, self.n_seq)

    def _new(self, pooling: int, threads: int):
        cp = _L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx      # a sequence is pooled whole, in one ubatch
        cp.n_seq_max = self.n_seq
        cp.n_threads = cp.n_threads_batch = max(1, threads)
        cp.embeddings = True
        cp.pooling_type = pooling
        cp.kv_unified = True
        cp.no_perf = True
        ctx = _L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise UnsupportedModelError(f"llama.cpp could not create an embeddings context: {native.last_error()}")
        return ctx

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """One L2-normalised row per input (float32, ``n_embd`` wide); inputs batched ``n_seq`` and ``n_ctx``
        tokens at a time."""
        out = np.zeros((len(inputs), self.n_embd), dtype=np.float32)
        i = 0
        while i < len(inputs):
            group, used = [], 0
            while i < len(inputs) and len(group) < self.n_seq and used + len(inputs[i]) <= self.n_ctx:
                group.append(i)
                used += len(inputs[i])
                i += 1
            if not group:
                raise LocalinferError(f"input {i} is {len(inputs[i])} tokens; the embeddings context holds "
                                      f"{self.n_ctx}")
            self._decode([inputs[j] for j in group])
            for s, j in enumerate(group):
                ptr = _L.llama_get_embeddings_seq(self._ctx, s)
                if not ptr:
                    raise LocalinferError("llama.cpp returned no pooled embedding")
                v = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float32)
                norm = float(np.linalg.norm(v))
                out[j] = v / norm if norm > 0 else v
        return out

    def _decode(self, seqs: list[Sequence[int]]) -> None:
        b, n = self._batch, 0
        for s, tokens in enumerate(seqs):
            for p, t in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = int(t), p, 1, 1
                b.seq_id[n][0] = s
                n += 1
        b.n_tokens = n
        _L.llama_memory_clear(self._mem, True)
        rc = _L.llama_decode(self._ctx, b)
        if rc != 0:
            raise LocalinferError(f"llama_decode failed with status {rc} on an embeddings batch")

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            _L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None) is not None:
            _L.llama_free(self._ctx)
            self._ctx = None
