"""A ggml graph recorded the way llama.cpp builds it: tensors first, nodes in the order expansion visits them.

llama.cpp creates tensors in one order and adds them to the graph in another: ``ggml_build_forward_expand``
(ggml/src/ggml.c ``ggml_visit_parents``) walks a tensor's sources depth first, left to right, and appends each
tensor not yet in the graph after its sources — a leaf (op NONE) to the leafs, anything else to the nodes.
Hybrid models expand small pieces early (the recurrent-state copies of ``build_rs``, the cache writes of
``build_attn``), so a layer's nodes interleave with the next layer's; recording the sources and replaying the
expansions reproduces that order, which is what the graph allocator (:mod:`.gallocr`) sees.

The recorder fills a :class:`~.compute_buffer._Graph`: sizes in bytes, layouts as (element size, shape) for
results (ggml ops write contiguous tensors), views sharing their base's memory, flags 1 input, 2 output,
4 external (weights, caches).
"""

from __future__ import annotations

from math import prod

from localinfer.backends.llamacpp.compute_buffer import _Graph


def _shape(shape) -> tuple[int, ...]:
    """ggml's ne with trailing ones dropped: (n, 1, 1) and (n,) are the same layout."""
    s = tuple(int(d) for d in shape)
    while len(s) > 1 and s[-1] == 1:
        s = s[:-1]
    return s


class Dag:
    """Tensors with their sources; :meth:`expand` appends them to the graph as ggml_build_forward_expand does."""

    def __init__(self):
        self.g = _Graph()
        self.shape: list[tuple[int, ...]] = []
        self.esize: list[int] = []
        self._in_graph: set[int] = set()

    def _add(self, size, shape, esize, op, src, view_src, flags, layout=None) -> int:
        t = self.g._new(size, layout if layout is not None else (esize,) + _shape(shape), op, src, view_src, 0,
                        flags)
        self.shape.append(_shape(shape))
        self.esize.append(esize)
        return t

    def input(self, shape, esize: int) -> int:
        """A graph input (``ggml_set_input``): allocated among the leafs when first visited."""
        return self._add(prod(shape) * esize, shape, esize, "NONE", (), None, 1)

    def weight(self, kind: str = "weight") -> int:
        t = self.g.weight(kind)
        self.shape.append(())
        self.esize.append(0)
        return t

    def cache(self) -> int:
        """A cache tensor (KV or recurrent state): external, written through views."""
        return self.weight("kv")

    def op(self, op: str, shape, esize: int, *src: int, output: bool = False) -> int:
        return self._add(prod(shape) * esize, shape, esize, op, src, None, 2 if output else 0)

    def f32(self, op: str, shape, *src: int) -> int:
        return self.op(op, shape, 4, *src)

    def dim(self, t: int, i: int) -> int:
        """ne[i] of ``t`` (1 past its stored dimensions: trailing ones are dropped)."""
        return self.shape[t][i] if i < len(self.shape[t]) else 1

    def base(self, t: int) -> int:
        return self.g.view_src[t] if self.g.view_src[t] is not None else t

    def view(self, parent: int, shape=None, contiguous: bool = True, strides=None) -> int:
        """A view, reshape, permute or transpose of ``parent`` (ggml_view_*, ggml_reshape_*, ...); ``strides``
        (nb[1:], bytes) of a strided view give its extent, ggml_nbytes."""
        shape = self.shape[parent] if shape is None else _shape(shape)
        es = self.esize[parent]
        lay = (es,) + shape if contiguous and strides is None else ("strided", es) + shape
        # its bytes matter only when the scheduler copies it to another device: a strided view without strides
        # spans about its parent; 0 elements are 0 bytes
        if strides is not None and prod(shape):
            size = es * shape[0] + sum((n - 1) * nb for n, nb in zip(shape[1:], strides))
        else:
            size = prod(shape) * es if contiguous or not prod(shape) else self.g.size[parent]
        return self._add(size, shape, es, "VIEW", (parent,), self.base(parent), self.g.flags[parent] & 4, layout=lay)

    def into(self, op: str, dst: int, *src: int) -> int:
        """An op writing into existing memory (ggml_cpy, ggml_set_rows, an *_inplace op): a view of ``dst``."""
        return self._add(0, self.shape[dst], self.esize[dst], op, src, self.base(dst), self.g.flags[dst] & 4)

    def expand(self, t: int) -> None:
        """ggml_build_forward_expand: sources first, left to right; leafs and nodes appended when first seen."""
        g, seen = self.g, self._in_graph
        stack = [(t, False)]
        while stack:
            x, done = stack.pop()
            if done:
                if g.op[x] == "NONE":
                    if not g.flags[x] & 4:        # weights and caches: never allocated, never graph inputs
                        g.leafs.append(x)
                else:
                    g.nodes.append(x)
                continue
            if x in seen:
                continue
            seen.add(x)
            stack.append((x, True))
            for s in reversed(g.src[x]):
                if s not in seen:
                    stack.append((s, False))
