"""Feed-forward blocks of llama.cpp's graphs, node by node, for :mod:`.compute_buffer`'s recorder.

They follow ``src/llama-graph.cpp``: ``build_ffn`` (a parallel SiLU gate: gate and up matmuls, one fused
SWIGLU, down) and ``build_moe_ffn`` (router logits, the gating function, an optional selection bias,
group-limited routing, top-k by argsort, the chosen weights gathered, normalised and scaled, then
gate/up/down ``mul_mat_id`` over the chosen experts, weighted, and the expert views summed).  Nodes are
emitted in the order ggml's depth-first graph walk visits them (sources left to right, after the
``ggml_build_forward_expand`` calls llama.cpp makes early), which is the order the allocator sees.
"""

from __future__ import annotations

from localinfer.model.arch import Routing

F32, I32 = 4, 4
SOFTMAX, SIGMOID, SOFTMAX_WEIGHT, SQRT_SOFTPLUS = 1, 2, 3, 4   # llama-hparams.h LLAMA_EXPERT_GATING_FUNC_TYPE_*


def dense_ffn(g, x: int, n_ff: int, n_embd: int, rows: int) -> int:
    """build_ffn(up, gate, down, LLM_FFN_SILU, LLM_FFN_PAR): gate, up, SWIGLU, down."""
    w = g.weight
    gate = g.op_("MUL_MAT", (n_ff, rows), F32, w(), x)
    up = g.op_("MUL_MAT", (n_ff, rows), F32, w(), x)
    act = g.op_("GLU", (n_ff, rows), F32, gate, up)
    return g.op_("MUL_MAT", (n_embd, rows), F32, w(), act)


def moe_ffn(g, x: int, *, n_embd: int, rows: int, n_expert: int, n_used: int, n_ff: int, routing: Routing,
            gating: int, probs_bias: bool, select_on_logits: bool = False, weight_before_ffn: bool = False,
            logits_bias: bool = False, expert_bias: bool = False) -> int:
    """build_moe_ffn over ``x`` (n_embd × rows); ``gating`` already resolved from the arch's default.

    ``select_on_logits`` and ``weight_before_ffn`` are llama4's: experts chosen on the raw logits, and the
    input scaled by the (sigmoid) weight before the expert matmuls instead of their output after.
    ``logits_bias`` adds the router's bias (gate_inp_b) to the logits, ``expert_bias`` each chosen expert's
    bias to its gate, up and down outputs (``ggml_add_id``): gpt-oss's (openai-moe.cpp)."""
    w = g.weight
    E, R, ne, nu = n_embd, rows, n_expert, n_used
    logits = g.op_("MUL_MAT", (ne, R), F32, w(name="ffn_gate_inp.weight"), x)
    if logits_bias:
        logits = g.op_("ADD", (ne, R), F32, logits, w(name="ffn_gate_inp.bias"))
    if gating == SOFTMAX:
        probs = g.op_("SOFT_MAX", (ne, R), F32, logits)
    elif gating == SIGMOID:
        probs = g.op_("UNARY", (ne, R), F32, logits)
    elif gating == SQRT_SOFTPLUS:
        probs = g.op_("SQRT", (ne, R), F32, g.op_("UNARY", (ne, R), F32, logits))
    else:
        probs = logits
    probs_3d = g.view(probs, (1, ne, R))
    sel = g.op_("ADD", (ne, R), F32, probs, w()) if probs_bias else probs
    if select_on_logits:
        sel = logits
    if routing.n_groups > 1 and R > 0:
        sel = _group_limit(g, sel, ne, R, routing)
    top = g.view(g.op_("ARGSORT", (ne, R), I32, sel), (nu, R), contiguous=False)
    weights = g.op_("GET_ROWS", (1, nu, R), F32, probs_3d, top)
    if gating == SOFTMAX_WEIGHT:
        weights = g.view(g.op_("SOFT_MAX", (nu, R), F32, g.view(weights, (nu, R))), (1, nu, R))
    if routing.weights_norm:
        flat = g.view(weights, (nu, R))
        total = g.op_("CLAMP", (1, R), F32, g.op_("SUM_ROWS", (1, R), F32, flat))
        weights = g.view(g.op_("DIV", (nu, R), F32, flat, total), (1, nu, R))
    if routing.weights_scale not in (0.0, 1.0):
        weights = g.op_("SCALE", (1, nu, R), F32, weights)
    xr = g.view(x, (E, 1, R))
    if weight_before_ffn:
        xr = g.op_("MUL", (E, nu, R), F32, g.op_("REPEAT", (E, nu, R), F32, xr), weights)

    def expert_mm(n, inp):
        t = g.op_("MUL_MAT_ID", (n, nu, R), F32, w(), inp, top)
        return g.op_("ADD_ID", (n, nu, R), F32, t, w(), top) if expert_bias else t

    gate = expert_mm(n_ff, xr)
    up = expert_mm(n_ff, xr)
    act = g.op_("GLU", (n_ff, nu, R), F32, gate, up)
    experts = expert_mm(E, act)
    if not weight_before_ffn:
        experts = g.op_("MUL", (E, nu, R), F32, experts, weights)
    views = [g.view(experts, (E, R), voff=i * E * F32, contiguous=False) for i in range(nu)]
    if nu == 1:
        return g.op_("CONT", (E, R), F32, views[0])
    out = views[0]
    for v in views[1:]:
        out = g.op_("ADD", (E, R), F32, out, v)
    return out


def _group_limit(g, sel: int, ne: int, R: int, routing: Routing) -> int:
    """Group-limited routing: keep the n_group_used groups whose two best experts score highest, the others
    filled with -inf (a FILL the kept rows are SET_ROWS into)."""
    G, per = routing.n_groups, ne // routing.n_groups
    groups = g.view(sel, (per, G, R))
    groups_4d = g.view(groups, (1, per, G, R))
    best2 = g.view(g.op_("ARGSORT", (per, G, R), I32, groups), (2, G, R), contiguous=False)
    scores = g.op_("GET_ROWS", (1, 2, G, R), F32, groups_4d, best2)
    scores = g.op_("SUM_ROWS", (1, G, R), F32, g.view(scores, (2, G, R)))
    kept = g.view(g.op_("ARGSORT", (G, R), I32, g.view(scores, (G, R))), (routing.n_group_used, R),
                  contiguous=False)
    rows = g.op_("GET_ROWS", (per, routing.n_group_used, R), F32, groups, kept)
    filled = g.op_("FILL", (per, G, R), F32, groups)
    masked = g._new(g.size[filled], g.layout[filled], "SET_ROWS", (rows, kept, filled), filled, 0, 0)
    g.nodes.append(masked)
    return g.view(masked, (ne, R))
