"""Decode steps captured in a CUDA graph (one graph per batch size).

``Transformer.decode`` with ``n_attn=None`` attends over the whole cache under a
mask built on the device, so one captured graph serves every step: replay
copies new token ids and positions into static buffers first.  Warm-up and
capture write into the cache at its last position (masked until a sequence
really gets there, and then overwritten), never into live tokens.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .model import Transformer


class GraphDecoder:
    """``decoder(tokens, pos) -> logits [b, vocab]`` for sequences 0..b-1, replayed from a graph."""

    def __init__(self, model: Transformer, cache: KVCache, batch: int, warmup: int = 2):
        if batch > cache.n_seq:
            raise ValueError(f"batch {batch} exceeds the cache's {cache.n_seq} sequences")
        dev = model.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.full((batch,), cache.capacity - 1, dtype=torch.long, device=dev)
        self.graph = None
        self.out = None
        if dev.type != "cuda":
            self._step = lambda: model.decode(self.tokens, self.pos, cache)
            return
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(warmup):
                model.decode(self.tokens, self.pos, cache)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.out = model.decode(self.tokens, self.pos, cache)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.out
