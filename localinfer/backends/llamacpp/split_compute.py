"""Compute buffers per device when llama.cpp splits layers across devices (``-sm layer``, RPC workers, GPUs).

llama.cpp's scheduler (ggml-backend.cpp, ``ggml_backend_sched_split_graph``)
gives every node of the graph a backend — the device of the weight it
multiplies, else its neighbours' by expansion (accelerators down, then up,
then every backend down and up), views that of their source, graph inputs the
CPU — cuts the node sequence into splits where the backend changes, and gives
each split a copy of every tensor it reads from another device.  With
pipeline parallelism (several devices, every layer offloaded, devices with
async compute and events, as RPC devices are) each copy and each graph input
exists ``n_copies`` = 4 times and is never freed.  Then one graph allocator
runs over the whole sequence with one arena per backend.  This module replays
all of it over the graph :mod:`.compute_buffer` builds; the result is each
backend's high-water mark, the figure llama.cpp logs as
``<device> compute buffer size``.
"""

from __future__ import annotations

from localinfer.backends.llamacpp.compute_buffer import (
    _INPLACE,
    ALIGN,
    _Graph,
    _llama_graph,
    attn_rotation,
    graph_builder,
)
from localinfer.backends.llamacpp.gallocr import replay
from localinfer.model.spec import ModelSpec

N_COPIES = 4          # GGML_SCHED_MAX_COPIES
OFFLOAD_MIN_BATCH = 32   # ggml-cuda / ggml-metal op_offload_min_batch_size (GGML_OP_OFFLOAD_MIN_BATCH)
_UNWEIGHTED = ("ROPE", "FLASH_ATTN_EXT")   # ops the weight rule skips (their small tensors must not decide)


def _is_view(g: _Graph, t: int) -> bool:
    return g.op[t] == "VIEW"


def assign(g: _Graph, unit_backend, cpu: int, pin_norms: bool, homes=None, offloads=None) -> list[int]:
    """Backend of every tensor after the scheduler's passes 1-4 (``unit_backend(unit)`` places weights/KV).

    ``pin_norms``: llama.cpp pins each layer's norms ("norm" tensors) to the layer's device when every layer
    is offloaded or a ubatch has fewer than 32 tokens (llama-context.cpp, graph_get_cb).  ``homes``: weight →
    (backend, in a host buffer) where a buffer override moved it; ``offloads(op, batch)``: the first device
    that asks for an op whose weight sits in a host buffer of the CPU (ggml-backend.cpp "1.off")."""
    bid = [-1] * len(g.size)
    for t, (unit, _) in g.home.items():
        bid[t] = unit_backend(unit)
    for t, (backend, _) in (homes or {}).items():
        bid[t] = backend
    for t in g.leafs:
        bid[t] = cpu
    if pin_norms:
        for t in g.nodes:
            if g.op[t] == "RMS_NORM" and isinstance(g.at[t], int):
                bid[t] = unit_backend(g.at[t])

    def is_weight(s: int) -> bool:
        base = g.view_src[s] if g.view_src[s] is not None else s
        return base in g.home and g.home[base][1] == "weight"

    for t in g.nodes:                                   # pass 1: pre-allocated sources and weights
        vs = g.view_src[t]
        if vs is not None and vs in g.home:
            bid[t] = bid[vs]
        elif g.op[t] not in _UNWEIGHTED:
            for s in g.src[t]:
                if is_weight(s):
                    w = g.view_src[s] if g.view_src[s] is not None else s
                    bid[t] = bid[w]
                    if offloads and bid[w] == cpu and (homes or {}).get(w, (cpu, False))[1]:
                        b = offloads(g.op[t], batch_size(g, t))
                        bid[t] = bid[t] if b is None else b
                    break
    order = [t for t in g.nodes if not _is_view(g, t)]
    for seq, skip_cpu in ((order, True), (order[::-1], True), (order, False), (order[::-1], False)):
        cur = -1                                        # pass 2: expand accelerators, then everything
        for t in seq:
            if bid[t] != -1:
                cur = -1 if skip_cpu and bid[t] == cpu else bid[t]
            elif cur != -1:
                bid[t] = cur
    for t in g.nodes:                                   # pass 4: views and unassigned sources
        if g.view_src[t] is not None and bid[t] == -1:
            bid[t] = bid[g.view_src[t]]
        for s in g.src[t]:
            if bid[s] == -1:
                bid[s] = bid[g.view_src[s]] if g.view_src[s] is not None else bid[t]
        if bid[t] == -1:
            bid[t] = 0
    return bid


def batch_size(g: _Graph, t: int) -> int:
    """ggml-cuda/ggml-metal ``get_op_batch_size``: ne[1] of a MUL_MAT, ne[2] of a MUL_MAT_ID, else the rows
    (GET_ROWS: 0, never offloaded)."""
    ne = [d for d in g.layout[t][1:]] + [1, 1, 1]
    if g.op[t] == "GET_ROWS":
        return 0
    if g.op[t] == "MUL_MAT":
        return ne[1]
    if g.op[t] == "MUL_MAT_ID":
        return ne[2]
    return ne[1] * ne[2] * ne[3]


def copy_bytes(g: _Graph, s: int, nbytes: int) -> int:
    """Bytes of the copy another backend makes of tensor ``s`` (``ggml_dup_tensor_layout``: same ne and nb, so
    ``ggml_nbytes`` = type size + Σ (ne[i] − 1)·nb[i]).  A view of the first ne[0] values of each row of a
    contiguous parent (the top-k expert ids, ``ggml_view_2d`` of the argsort) spans its parent's rows but the
    last: (ne[0] − ne0)·esize bytes fewer than the parent."""
    lay, par = g.layout[s], g.src[s][0] if g.op[s] == "VIEW" and g.src[s] else None
    if par is None or not lay or lay[0] != "strided" or not g.layout[par] or not isinstance(g.layout[par][0], int):
        return nbytes
    esize, pshape, shape = g.layout[par][0], g.layout[par][1:], lay[1:]
    if len(shape) != len(pshape) or shape[1:] != pshape[1:] or shape[0] > pshape[0]:
        return nbytes
    stride, out = esize, esize
    for i, n in enumerate(shape):
        out += (n - 1) * stride
        stride *= pshape[i]
    return out


def offload_rule(kinds: list[str]):
    """``offloads(op, batch)`` for the devices of ``kinds``: the first that asks for the op (None: none).

    ggml-cuda ``ggml_backend_cuda_device_offload_op``: every op with a batch of at least 32 (the env
    GGML_OP_OFFLOAD_MIN_BATCH changes it); ggml-metal: MUL_MAT and MUL_MAT_ID with a batch of at least 32;
    RPC devices have no ``offload_op`` (ggml-rpc.cpp: NULL) and CPU devices none either."""
    def offloads(op: str, batch: int):
        for b, kind in enumerate(kinds):
            if kind == "cuda" and batch >= OFFLOAD_MIN_BATCH:
                return b
            if kind == "metal" and op in ("MUL_MAT", "MUL_MAT_ID") and batch >= OFFLOAD_MIN_BATCH:
                return b
        return None
    return offloads


def expert_weights(g: _Graph) -> dict[int, str]:
    """The graph's expert tensors by name: the weights of each layer's MUL_MAT_IDs, gate, up, down, the
    per-expert biases an ADD_ID adds to their outputs (gpt-oss's ``ffn_*_exps.bias``), and the router's weight
    and bias (``ffn_gate_inp``), which fit.cpp's partial-layer patterns move with the experts."""
    out: dict[int, str] = {w: f"blk.{g.home[w][0]}.{name}" for w, name in g.names.items()
                           if isinstance(g.home[w][0], int)}
    seen: dict[object, int] = {}
    kind: dict[int, str] = {}                   # MUL_MAT_ID node -> its tensor's name stem
    for t in g.nodes:
        if g.op[t] == "MUL_MAT_ID" and g.src[t] and g.src[t][0] in g.home:
            w = g.src[t][0]
            unit = g.home[w][0]
            i = seen.get(unit, 0)
            seen[unit] = i + 1
            if i < 3:
                kind[t] = f"blk.{unit}.ffn_{('gate', 'up', 'down')[i]}_exps"
                out[w] = kind[t] + ".weight"
        elif g.op[t] == "ADD_ID" and len(g.src[t]) > 1 and g.src[t][0] in kind and g.src[t][1] in g.home:
            out[g.src[t][1]] = kind[g.src[t][0]] + ".bias"
    return out


def schedule(g: _Graph, bid: list[int], n_copies: int, weight_splits: bool = False):
    """Pass 5 and the graph copy: (leafs, nodes, backend, flags, srcs, view_src, counted-as-view) for the replay.

    ``weight_splits``: a node reading a weight of another backend starts a new split even on the same backend
    ("by starting a new split, the memory of the previously offloaded weights can be reused")."""
    size, layout = list(g.size), list(g.layout)
    flags, src, view_src = list(g.flags), [list(s) for s in g.src], list(g.view_src)
    bid = list(bid)

    def new(nbytes, lay, backend, fl, srcs=(), vsrc=None) -> int:
        size.append(nbytes)
        layout.append(lay)
        flags.append(fl)
        src.append(list(srcs))
        view_src.append(vsrc)
        bid.append(backend)
        return len(size) - 1

    splits: list[tuple[int, list[int], list[int]]] = []     # backend, inputs, nodes
    copies: dict[tuple[int, int], list[int]] = {}
    def foreign_weight(t: int) -> bool:
        return any(s in g.home and g.home[s][1] == "weight" and bid[s] != bid[t] for s in src[t])

    for t in g.nodes:
        if not _is_view(g, t) and (not splits or bid[t] != splits[-1][0] or
                                   (weight_splits and splits[-1][1] and foreign_weight(t))):
            splits.append((bid[t], [], []))
        if not splits:
            splits.append((bid[t], [], []))
        backend, inputs, nodes = splits[-1]
        nodes.append(t)
        if _is_view(g, t):
            continue
        for j, s in enumerate(src[t]):
            if bid[s] == backend:
                continue
            key = (s, backend)
            if key not in copies:
                fl = (1 | 2) if n_copies > 1 else 0
                copies[key] = [new(copy_bytes(g, s, size[s]), layout[s], backend, fl) for _ in range(n_copies)]
                inputs.append(s)
            src[t][j] = copies[key][0]
    leafs: list[int] = []
    if n_copies > 1:
        for t in g.leafs:                               # every graph input, n_copies times, never freed
            flags[t] |= 2
            leafs.append(t)
            leafs += [new(size[t], layout[t], bid[t], 1 | 2) for _ in range(n_copies - 1)]
        for backend, inputs, _ in splits:
            for s in inputs:
                leafs += copies[(s, backend)]
    leafs += list(g.leafs)
    order: list[int] = []
    dep_view: set[int] = set()
    for backend, inputs, nodes in splits:
        for s in inputs:
            base = view_src[s] if view_src[s] is not None else s
            dep = new(0, (), bid[s], 0, (s,), base)   # keeps the source alive until it is copied
            dep_view.add(dep)
            order += [dep, copies[(s, backend)][0]]
        order += nodes
    return leafs, order, bid, flags, src, view_src, size, layout, dep_view


def split_compute(spec: ModelSpec, unit_backend, kinds: list[str], *, n_kv: int, n_ubatch: int, n_outputs: int,
                  flash_attn: bool, n_kv_swa: int | None = None, type_k: str = "f16", type_v: str = "f16",
                  pipeline: bool = False, pin_norms: bool = False, n_seqs: int = 1, tensor_home=None,
                  pins: bool = True) -> list[int]:
    """Compute buffer bytes per backend: ``kinds`` lists the devices ("cpu" for an RPC worker's CPU, "cuda",
    "metal"), the host CPU is appended last; ``unit_backend(unit)`` gives the backend index of "in", each layer
    index and "out" (``len(kinds)`` for the host); the family's graph (:func:`graph_builder`) over ``n_seqs``
    sequences.

    ``tensor_home(name)``: (backend, host buffer, bytes) of an expert tensor a buffer override moved, else None.
    The scheduler then runs a MUL_MAT_ID on its weight's backend, or, for a weight in a host buffer (not
    CPU_REPACK: ggml-cpu repack.cpp's buffer is not host) and a batch of 32 or more, on the device that asks
    for it (:func:`offload_rule`), which copies the weight into its compute buffer for that split.
    ``pins`` False: no norm pinned to its layer's device (llama.cpp's dry run resets the scheduler after the
    graph callback pinned them)."""
    build, layers, _ = graph_builder(spec)
    if build is _llama_graph:
        layers = [il for il in range(spec.n_layers) if spec.n_head[il] and spec.n_head_kv[il]] or [0]
    rot = (attn_rotation(spec.head_dim_k, type_k), attn_rotation(spec.head_dim_v, type_v))
    g = build(spec, list(layers), n_kv, n_ubatch, n_outputs, flash_attn, n_kv if n_kv_swa is None else n_kv_swa,
              type_k if rot[0] else "f16", type_v if rot[1] else "f16", n_seqs=n_seqs)
    cpu = len(kinds)
    homes = {}
    if tensor_home is not None:
        for w, name in expert_weights(g).items():
            home = tensor_home(name)
            if home is not None:
                homes[w] = home[:2]
                g.size[w] = home[2]          # the size of the copy a device makes of it
    bid = assign(g, unit_backend, cpu, pins and (pin_norms or n_ubatch < 32), homes,
                 offload_rule(kinds) if homes else None)
    leafs, nodes, bid, flags, src, view_src, size, layout, dep = schedule(g, bid, N_COPIES if pipeline else 1,
                                                                          weight_splits=bool(homes))
    ops = g.op + ["NONE"] * (len(size) - len(g.op))
    aligns = [ALIGN.get(k, 32) for k in kinds] + [ALIGN["cpu"]]
    return replay(aligns, leafs, nodes, bid, flags, src, view_src, size, layout, lambda t: ops[t] in _INPLACE,
                  dep)
