"""llama.cpp's compute buffer, predicted by replaying its graph allocator.

llama.cpp sizes the compute buffer by building the worst-case graph (a full
``n_ubatch`` of tokens, ``min(n_ubatch, n_outputs_max)`` logit rows, the whole
KV cache visible) and running ggml's graph allocator over it: tensors are
placed best-fit in a growing arena, freed after their last consumer,
and some ops (norms, adds, rope, softmax...) write in place over a parent that
has no other consumer (:mod:`.gallocr`).  The buffer is the arena's high-water mark, holes
included — which is why no closed formula gets it right.

This module builds the same node sequence for llama-style decoders (llama,
qwen2, qwen3, qwen3moe, gemma3, glm4moe, llama4, gpt-oss and relatives) from a
:class:`ModelSpec` and replays the allocator in pure Python.  On this machine it reproduces llama.cpp's CPU
compute buffer to the byte (see tests/test_fit_llamacpp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from localinfer.backends.llamacpp.gallocr import replay
from localinfer.backends.llamacpp.graph_ffn import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, dense_ffn, moe_ffn
from localinfer.model.spec import ModelSpec
from localinfer.util.memo import spec_cache

F32, F16, I32, I64 = 4, 2, 4, 8
ALIGN = {"cpu": 32, "metal": 32, "cuda": 128}
# ggml-alloc.c ggml_op_can_inplace
_INPLACE = {"FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV", "SQR",
            "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK", "CLAMP",
            "SOFT_MAX", "SOFT_MAX_BACK"}
_FULL_LAYERS = 6   # graphs deeper than this are replayed with the middle layers folded (identical state)
# graphs checked byte for byte against llama.cpp (tests/test_fit_llamacpp.py); others reuse the llama graph
VERIFIED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "glm4moe", "llama4", "gpt-oss")
# other families' graph builders: module (in this package) -> the architectures whose graph it builds
# graphs that keep every row through the last layer, mark that layer's output as a graph output (res->t_h_nextn,
# llama-graph.cpp set_outputs) and only then take the output rows: src/models/openai-moe.cpp (embeddings_nextn_masked
# off by default); the others drop the unused rows inside the last layer (ggml_get_rows on the attention output)
_ROWS_AFTER_TRUNK = ("gpt-oss",)
_FAMILY_GRAPHS = {"graph_mla": ("deepseek2",), "graph_hybrid": ("qwen35", "qwen35moe", "qwen3next", "granitehybrid",
                                                                "nemotron_h", "nemotron_h_moe", "lfm2", "lfm2moe",
                                                                "mamba", "mamba2")}


@dataclass(frozen=True)
class ComputeEstimate:
    device: int          # the compute buffer on the device running the layers
    host: int            # host-side compute buffer (inputs, embedding lookup) when offloading
    formula: str
    host_formula: str = ""


class _Graph:
    """A ggml graph as the allocator sees it: leafs first, then nodes in execution order."""

    def __init__(self):
        self.size: list[int] = []
        self.layout: list[tuple] = []
        self.op: list[str] = []
        self.src: list[tuple[int, ...]] = []
        self.view_src: list[int | None] = []
        self.voff: list[int] = []
        self.flags: list[int] = []      # 1 input, 2 output, 4 external (weights, KV cache)
        self.nodes: list[int] = []
        self.leafs: list[int] = []
        self.unit: object = "in"         # the layer being built ("in", an index, "out"): where weights live
        self.home: dict[int, tuple] = {}  # external tensor -> (unit, "weight" | "kv"), for the layer split
        self.at: list[object] = []         # the unit each tensor was built in
        self.names: dict[int, str] = {}    # weight -> its name in its layer ("ffn_gate_inp.weight"), where known

    def _new(self, size, layout, op, src, view_src, voff, flags) -> int:
        self.size.append(size)
        self.layout.append(layout)
        self.op.append(op)
        self.src.append(tuple(src))
        self.view_src.append(view_src)
        self.voff.append(voff)
        self.flags.append(flags)
        self.at.append(self.unit)
        return len(self.size) - 1

    def leaf(self, nbytes: int, shape: tuple, flags: int) -> int:
        t = self._new(nbytes, shape, "NONE", (), None, 0, flags)
        self.leafs.append(t)
        return t

    def weight(self, kind: str = "weight", name: str | None = None) -> int:
        t = self._new(0, (), "NONE", (), None, 0, 4)
        self.home[t] = (self.unit, kind)
        if name:
            self.names[t] = name
        return t

    def op_(self, op: str, shape: tuple, esize: int, *src: int, flags: int = 0) -> int:
        n = 1
        for d in shape:
            n *= d
        t = self._new(n * esize, (esize,) + tuple(shape), op, src, None, 0, flags)
        self.nodes.append(t)
        return t

    def view(self, parent: int, shape: tuple | None = None, voff: int = 0, contiguous: bool = True) -> int:
        base = self.view_src[parent] if self.view_src[parent] is not None else parent
        lay = self.layout[parent] if shape is None else ((self.layout[parent][:1] + tuple(shape)) if contiguous
                                                         else ("strided",) + tuple(shape))
        t = self._new(self.size[parent], lay, "VIEW", (parent,), base, voff, self.flags[parent] & 4)
        self.nodes.append(t)
        return t


def attn_rotation(head_dim: int, type_name: str) -> int:
    """Size of the Hadamard rotation llama.cpp applies around a quantized KV cache (0: none).

    On when the cache type is quantized and the head size is a multiple of 64:
    K uses the largest power of two dividing the head size, V a 64×64 block.
    """
    if type_name in ("f32", "f16", "bf16") or head_dim % 64:
        return 0
    return head_dim & -head_dim


def _llama_graph(spec: ModelSpec, layers: list[int], n_kv: int, n_tokens: int, n_outputs: int,
                 flash_attn: bool, n_kv_swa: int, type_k: str = "f16", type_v: str = "f16",
                 n_stream: int = 1, n_seqs: int = 1) -> _Graph:
    """The node sequence llama.cpp builds for one ubatch of a llama-style decoder (``n_stream`` KV streams;
    ``n_seqs``, the ubatch's sequences, changes no size here: the KV streams split the tokens, not the bytes)."""
    g = _Graph()
    E, T, O = spec.n_embd, n_tokens, n_outputs
    hd, hdv = spec.head_dim_k, spec.head_dim_v
    has = {t.name.split(".", 2)[-1] for t in spec.tensors if t.name.startswith("blk.0.")}
    bias = {k: f"attn_{k}.bias" in has for k in "qkv"}
    o_bias = "attn_output.bias" in has          # build_attn: ggml_add(cur, wo_b) after the output projection
    qk_norm = "attn_q_norm.weight" in has
    rope_freqs = spec.tensor("rope_freqs.weight") is not None
    moe = spec.n_expert > 0
    kv_all = max((spec.n_head_kv[il] * hdv for il in layers), default=0)
    swa = spec.has_swa
    rot_k = attn_rotation(hd, type_k)
    rot_v = 64 if attn_rotation(hdv, type_v) else 0
    tokens = g.leaf(T * I32, (T,), 1)
    g.leaf(E * T * F32, (E, T), 1)                 # inp_embd: created, never used, never freed
    pos = g.leaf(T * I32, (T,), 1)
    rot_leaves: dict[tuple[str, bool], int] = {}   # ("k" | "v", sliding cache?) -> that cache's rotation input

    def rot_leaf(kind: str, is_swa: bool) -> int:
        if (kind, is_swa) not in rot_leaves:  # each cache of an iswa pair has its own, created where first used
            r = rot_k if kind == "k" else rot_v
            rot_leaves[kind, is_swa] = g.leaf(r * r * F32, (r, r), 1)
        return rot_leaves[kind, is_swa]
    mesize = F16 if flash_attn else F32
    kv_inputs: dict[bool, tuple[int, int, int]] = {}   # per cache (full / sliding): k idx, v idx, mask

    def kv_input(is_swa: bool) -> tuple[int, int, int]:
        if is_swa not in kv_inputs:   # created where first used: that is the allocator's leaf order
            n = n_kv_swa if is_swa else n_kv
            kv_inputs[is_swa] = (g.leaf(T * I64, (T,), 1),
                                 g.leaf((T if flash_attn else kv_all * T) * I64, (T,), 1),
                                 g.leaf(n * T * mesize, (n, T), 1))
        return kv_inputs[is_swa]

    gemma = spec.arch.startswith("gemma")
    llama4 = spec.arch == "llama4"
    moe_args = _moe_args(spec)
    attn_scale: list[int] = []      # llama4's temperature input, a leaf where first used (no-rope layers)
    post_norms = "post_attention_norm.weight" in has and "post_ffw_norm.weight" in has
    out_ids = None
    rows_late = spec.arch in _ROWS_AFTER_TRUNK
    w = g.weight

    def proj(x, n, key, heads, dim, norm):
        t = g.op_("MUL_MAT", (n, T), F32, w(), x)
        if bias[key]:
            t = g.op_("ADD", (n, T), F32, t, w())
        t = g.view(t, (dim, heads, T))
        if norm and qk_norm:
            t = g.op_("RMS_NORM", (dim, heads, T), F32, t)
            t = g.op_("MUL", (dim, heads, T), F32, t, w())
        return t

    def f16_views(kp, vp, k_shape, v_shape):
        """build_attn_mha: flash attention reads an f32 cache through f16 copies (one per stream)."""
        if type_k == "f32":
            kp = g.op_("CPY", k_shape + (n_stream,), F16, kp)
        if type_v == "f32":
            vp = g.op_("CPY", v_shape + (n_stream,), F16, vp)
        return kp, vp

    def rotate(t, kind, is_swa, shape):
        rot = rot_leaf(kind, is_swa)
        r = rot_k if kind == "k" else rot_v
        n = 1
        for d in shape:
            n *= d
        t = g.op_("MUL_MAT", (r, n // r), F32, rot, g.view(t, (r, n // r)))
        return g.view(t, shape)

    def keys(x, heads, rope, is_swa):
        t = proj(x, heads * hd, "k", heads, hd, True)
        if rope:
            t = g.op_("ROPE", (hd, heads, T), F32, t, pos, *((w(),) if rope_freqs else ()))
            if llama4 and spec.n_expert != 128:          # Llama4TextL2Norm (use_kq_norm)
                t = g.op_("RMS_NORM", (hd, heads, T), F32, t)
        return rotate(t, "k", is_swa, (hd, heads, T)) if rot_k else t

    def values(x, heads, is_swa):
        t = proj(x, heads * hdv, "v", heads, hdv, False)
        return rotate(t, "v", is_swa, (hdv, heads, T)) if rot_v else t

    cur = g.op_("GET_ROWS", (E, T), F32, w(), tokens)
    if gemma:
        cur = g.op_("SCALE", (E, T), F32, cur)
    last = layers[-1]
    for il in layers:
        g.unit = il
        H, Hkv = spec.n_head[il], spec.n_head_kv[il]
        nq, nk, nv = H * hd, Hkv * hd, Hkv * hdv
        is_swa = bool(swa and spec.swa_layers[il])
        inp = cur
        x = g.op_("RMS_NORM", (E, T), F32, inp)
        x = g.op_("MUL", (E, T), F32, x, w())

        rope = not llama4 or (il + 1) % (4 if swa else spec.n_layers) != 0   # llama4: n_no_rope_layer_step
        q = proj(x, nq, "q", H, hd, True)
        if rope:
            q = g.op_("ROPE", (hd, H, T), F32, q, pos, *((w(),) if rope_freqs else ()))
            if llama4 and spec.n_expert != 128:
                q = g.op_("RMS_NORM", (hd, H, T), F32, q)
        elif llama4:
            if not attn_scale:
                attn_scale.append(g.leaf(T * F32, (1, 1, T), 1))
            q = g.op_("MUL", (hd, H, T), F32, q, attn_scale[0])
        if gemma:
            q = g.op_("SCALE", (hd, H, T), F32, q)
        if rot_k:
            q = rotate(q, "k", is_swa, (hd, H, T))
        if swa:                      # build_attn expands Q, K, V with sliding-window caches (iswa), Q, V, K without
            k = keys(x, Hkv, rope, is_swa)
            v = values(x, Hkv, is_swa)
        else:
            v = values(x, Hkv, is_swa)
            k = keys(x, Hkv, rope, is_swa)
        k_idx, v_idx, m = kv_input(is_swa)
        kc, vc = g.weight("kv"), g.weight("kv")
        g.nodes.append(g._new(0, (), "SET_ROWS", (g.view(k, (nk, T)), k_idx, kc), kc, 0, 4))
        if flash_attn:
            g.nodes.append(g._new(0, (), "SET_ROWS", (g.view(v, (nv, T)), v_idx, vc), vc, 0, 4))
        else:
            vr = g.view(g.view(v, (nv, T)), (1, nv * T))
            g.nodes.append(g._new(0, (), "SET_ROWS", (vr, v_idx, g.view(vc, (1,), contiguous=False)), vc, 0, 4))
        kv_len = n_kv_swa if is_swa else n_kv
        qp = g.view(g.view(q), (hd, T, H), contiguous=False)
        kp = g.view(g.view(kc, (hd, Hkv, kv_len), contiguous=False), (hd, kv_len, Hkv), contiguous=False)
        vp = g.view(g.view(vc, (hd, Hkv, kv_len), contiguous=False), (hd, kv_len, Hkv), contiguous=False)
        if flash_attn:
            kp, vp = f16_views(kp, vp, (hd, kv_len, Hkv), (hdv, kv_len, Hkv))
            a = g.op_("FLASH_ATTN_EXT", (hdv, H, T), F32, qp, kp, vp, m)
            a = g.view(a, (hdv * H, T))
            if rot_v:
                a = rotate(a, "v", is_swa, (hdv * H, T))
        else:
            kq = g.op_("MUL_MAT", (kv_len, T, H), F32, kp, qp)
            kq = g.op_("SOFT_MAX", (kv_len, T, H), F32, kq, m)
            kqv = g.op_("MUL_MAT", (hdv, T, H), F32, vp, kq)
            a = g.op_("CONT", (hdv * H, T), F32, g.view(kqv, (hdv, H, T), contiguous=False))
        a = g.op_("MUL_MAT", (E, T), F32, w(), a)
        if o_bias:
            a = g.op_("ADD", (E, T), F32, a, w())
        trim = il == last and not rows_late
        R = O if trim else T
        if trim:
            out_ids = g.leaf(O * I32, (O,), 1)
            a = g.op_("GET_ROWS", (E, O), F32, a, out_ids)
        if post_norms:
            a = g.op_("MUL", (E, R), F32, g.op_("RMS_NORM", (E, R), F32, a), w())
        if trim:
            inp = g.op_("GET_ROWS", (E, O), F32, inp, out_ids)
        res = g.op_("ADD", (E, R), F32, a, inp)
        x = g.op_("RMS_NORM", (E, R), F32, res)
        x = g.op_("MUL", (E, R), F32, x, w())
        if moe and il >= spec.routing.n_dense_lead and spec.tensor(f"blk.{il}.ffn_gate_inp.weight") is not None:
            ff = spec.expert_ff or spec.n_ff[il]
            f = moe_ffn(g, x, n_embd=E, rows=R, n_expert=spec.n_expert, n_used=spec.n_expert_used, n_ff=ff,
                        probs_bias=spec.tensor(f"blk.{il}.exp_probs_b.bias") is not None,
                        logits_bias=spec.tensor(f"blk.{il}.ffn_gate_inp.bias") is not None,
                        expert_bias=spec.tensor(f"blk.{il}.ffn_up_exps.bias") is not None, **moe_args)
            if spec.n_expert_shared or spec.tensor(f"blk.{il}.ffn_up_shexp.weight") is not None:
                f = g.op_("ADD", (E, R), F32, f, dense_ffn(g, x, ff * max(spec.n_expert_shared, 1), E, R))
        else:
            f = dense_ffn(g, x, spec.n_ff[il], E, R)
        if post_norms:
            f = g.op_("MUL", (E, R), F32, g.op_("RMS_NORM", (E, R), F32, f), w())
        cur = g.op_("ADD", (E, R), F32, f, res, flags=2 if il == last and rows_late else 0)
    g.unit = "out"
    if rows_late:
        out_ids = g.leaf(O * I32, (O,), 1)
        cur = g.op_("GET_ROWS", (E, O), F32, cur, out_ids)
    x = g.op_("RMS_NORM", (E, O), F32, cur)
    x = g.op_("MUL", (E, O), F32, x, w(), flags=2)
    g.op_("MUL_MAT", (spec.vocab_size, O), F32, w(), x, flags=2)
    return g


def _moe_args(spec: ModelSpec) -> dict:
    """build_moe_ffn's routing for the llama-graph families: the gating, normalisation and ordering each
    family's graph passes (src/models/*.cpp), most of them softmax with the chosen weights normalised."""
    from dataclasses import replace

    r = spec.routing
    if spec.arch == "glm4moe":      # glm4-moe.cpp: the file's keys, sigmoid when none is written
        return {"routing": r, "gating": r.gating or SIGMOID}
    if spec.arch == "gpt-oss":      # openai-moe.cpp: softmax over the chosen experts' logits, not normalised
        return {"routing": replace(r, weights_norm=False), "gating": SOFTMAX_WEIGHT}
    if spec.arch == "llama4":       # llama4.cpp: sigmoid, no normalisation, chosen on the logits, weighted first
        return {"routing": replace(r, weights_norm=False), "gating": SIGMOID, "select_on_logits": True,
                "weight_before_ffn": True}
    return {"routing": replace(r, weights_norm=True), "gating": SOFTMAX}


def graph_builder(spec: ModelSpec):
    """(build, layers, verified): the function that builds ``spec``'s graph (``_llama_graph``'s signature, with
    the keywords ``n_stream``, the KV streams (n_seq unless unified), and ``n_seqs``, the worst-case ubatch's
    sequences), the layers it is built over, and whether it was checked against llama.cpp.  A family module
    registers its builder as ``GRAPH`` (with ``VERIFIED``) and the architectures it covers in
    ``_FAMILY_GRAPHS``.  Memoised per spec (the layer scan reads every tensor name)."""
    memo = spec_cache(spec)
    if "graph_builder" not in memo:
        memo["graph_builder"] = _graph_builder(spec)
    return memo["graph_builder"]


def _graph_builder(spec: ModelSpec):
    import importlib

    for module, archs in _FAMILY_GRAPHS.items():
        if spec.arch in archs:
            try:
                mod = importlib.import_module(f"{__package__}.{module}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__package__}.{module}":
                    raise
                break
            return mod.GRAPH, tuple(range(spec.n_layers)), spec.arch in getattr(mod, "VERIFIED", ())
    layers = [il for il in range(spec.n_layers) if spec.n_head[il] and spec.n_head_kv[il]] or [0]
    return _llama_graph, _replay_layers(spec, layers), spec.arch in VERIFIED_ARCHS


def _replay(g: _Graph, align: int, sizes: list[int]) -> int:
    """ggml_gallocr over the graph on one backend: the arena's high-water mark in bytes."""
    return replay([align], g.leafs, g.nodes, [0] * len(sizes), g.flags, g.src, g.view_src, sizes, g.layout,
                  lambda t: g.op[t] in _INPLACE)[0]


_BIG = 1_000_003   # a prime no model dimension equals: shapes built with it never collide by accident


def _template(spec: ModelSpec, layers: tuple[int, ...], n_ubatch: int, n_outputs: int, flash_attn: bool,
              type_k: str, type_v: str, n_stream: int = 1, n_seqs: int = 1):
    """The graph once, with every tensor size as base + a·n_kv + b·n_kv_swa (sizes are linear in both)."""
    memo = spec_cache(spec)
    key = ("graph", layers, n_ubatch, n_outputs, flash_attn, type_k, type_v, n_stream, n_seqs)
    if key not in memo:
        args = (n_ubatch, n_outputs, flash_attn)
        build = graph_builder(spec)[0]
        streams = {"n_stream": n_stream, "n_seqs": n_seqs}
        g0 = build(spec, list(layers), _BIG, *args, _BIG, type_k, type_v, **streams)
        g1 = build(spec, list(layers), _BIG + 1, *args, _BIG, type_k, type_v, **streams)
        g2 = build(spec, list(layers), _BIG, *args, _BIG + 1, type_k, type_v, **streams)
        coef = [(s0 - (s1 - s0) * _BIG - (s2 - s0) * _BIG, s1 - s0, s2 - s0)
                for s0, s1, s2 in zip(g0.size, g1.size, g2.size)]
        memo[key] = (g0, coef)
    return memo[key]


def _pp_compute(spec: ModelSpec, layers: tuple[int, ...], n_kv: int, n_ubatch: int, n_outputs: int,
                flash_attn: bool, n_kv_swa: int, align: int, type_k: str = "f16", type_v: str = "f16",
                n_stream: int = 1, n_seqs: int = 1) -> int:
    memo = spec_cache(spec)
    rot = (attn_rotation(spec.head_dim_k, type_k), attn_rotation(spec.head_dim_v, type_v))
    tk = type_k if rot[0] or type_k == "f32" else "f16"    # the graph sees the type only through these
    tv = type_v if rot[1] or type_v == "f32" else "f16"
    key = ("compute", layers, n_kv, n_ubatch, n_outputs, flash_attn, n_kv_swa, align, tk, tv, n_stream, n_seqs)
    if key not in memo:
        g, coef = _template(spec, layers, n_ubatch, n_outputs, flash_attn, tk, tv, n_stream, n_seqs)
        sizes = [c + a * n_kv + b * n_kv_swa for c, a, b in coef]
        memo[key] = _replay(g, align, sizes)
    return memo[key]


def _replay_layers(spec: ModelSpec, layers: list[int]) -> tuple[int, ...]:
    """Layers to replay: all of them, or the first and last few when the middle repeats exactly (the same
    tensors from the fourth layer on: up to three leading dense layers fold, interleaved MoE does not)."""
    uniform = (len({spec.n_head[il] for il in layers}) == 1 and len({spec.n_head_kv[il] for il in layers}) == 1
               and len({spec.n_ff[il] for il in layers}) == 1 and not spec.has_swa)
    if len(layers) <= _FULL_LAYERS or not uniform:
        return tuple(layers)
    kinds: dict[int, set[str]] = {il: set() for il in layers[3:]}
    for t in spec.tensors:
        parts = t.name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) in kinds:
            kinds[int(parts[1])].add(parts[2])
    if len({frozenset(v) for v in kinds.values()}) > 1:
        return tuple(layers)
    return tuple(layers[:3] + layers[-3:])


def compute_estimate(spec: ModelSpec, *, n_kv: int, n_ubatch: int, n_outputs: int, flash_attn: bool,
                     kind: str, gpu_layers: int, type_k: str = "f16", type_v: str = "f16",
                     n_kv_swa: int | None = None, n_stream: int = 1, n_seqs: int = 1) -> ComputeEstimate:
    """The compute buffer(s) llama.cpp reserves for this context.

    ``n_kv`` is the cells of one KV stream (of ``n_stream``), ``n_outputs`` the logit rows of the
    worst-case ubatch (min(n_ubatch, n_outputs_max)), ``n_seqs`` its sequences (n_seq_max: recurrent
    layers' shapes depend on it).  For an accelerator the
    layers run on the device and the host keeps the inputs and the embedding
    lookup; partial offload adds one CPU layer's weights copied up per step
    (an estimate: not verified on a GPU here).
    """
    _, layers, verified = graph_builder(spec)
    align = ALIGN.get(kind, 32)
    swa = n_kv if n_kv_swa is None else n_kv_swa
    formula = (f"ggml graph allocator replayed over the {spec.arch} graph: ubatch {n_ubatch} tokens, "
               f"{n_outputs} logit rows, {n_kv} KV cells, flash attention {'on' if flash_attn else 'off'}")
    if not verified:
        formula += f" (approximate: the graph is not checked against llama.cpp's for {spec.arch!r})"
    try:
        dev = _pp_compute(spec, layers, n_kv, n_ubatch, n_outputs, flash_attn, swa, align,
                          type_k, type_v, n_stream, n_seqs)
    except (ValueError, TypeError, ZeroDivisionError, IndexError):   # metadata the graph cannot be built from
        E, T, F = spec.n_embd, n_ubatch, max(spec.n_ff, default=0) or 4 * spec.n_embd
        dev = (spec.vocab_size * n_outputs + 4 * E * T + 3 * F * T) * F32
        formula = "logits + 4 activations + 3 FFN intermediates (rough: the graph could not be built)"
    if kind == "cpu":
        return ComputeEstimate(dev, 0, formula)
    T, E = n_ubatch, spec.n_embd
    mesize = F16 if flash_attn else F32
    host = T * I32 * 2 + 2 * E * T * F32 + T * I64 + n_kv * T * mesize + n_outputs * I32
    host_formula = "inputs (tokens, positions, KV indices, mask, output ids) + embedding rows"
    if gpu_layers < spec.n_layers:
        cpu_layers = spec.layer_bytes[: spec.n_layers - gpu_layers]
        copy = max(cpu_layers, default=0)
        dev += copy
        formula += (f" + the largest host layer's weights ({copy} B) copied up for batched matmuls "
                    "(op offload; an estimate, not verified on a GPU here)")
        if gpu_layers == 0:
            host = dev - copy
            host_formula = "the whole graph runs on the host (same replay)"
    return ComputeEstimate(dev, host, formula, host_formula)
