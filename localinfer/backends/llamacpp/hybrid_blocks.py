"""The pieces hybrid recurrent graphs share, recorded on a :class:`~.ggml_dag.Dag` in llama.cpp's order.

Each function follows one llama.cpp builder (src/llama-graph.cpp): ``build_inp_embd``, ``build_rs`` (the state
rows of the sequences in the ubatch gathered from the recurrent cache), ``build_attn`` with
``build_attn_mha`` (cache writes, flash attention or KQ/softmax/KQV, the Hadamard rotation of a quantized
cache), ``build_ffn``, ``build_moe_ffn`` (softmax gating, normalised top-k weights) and the output head.
The worst-case ubatch (llama-context.cpp ``graph_reserve``) holds ``n_seqs`` = n_seq_max sequences of
T / n_seqs tokens, every KV cell visible and n_rs = n_seqs state rows, so no extra state rows are copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from localinfer.backends.llamacpp.compute_buffer import attn_rotation
from localinfer.backends.llamacpp.ggml_dag import Dag
from localinfer.model.spec import ModelSpec

F32, F16, I32, I64 = 4, 2, 4, 8


@dataclass
class Ubatch:
    """What every block needs: the recorder, the model and the worst-case ubatch's sizes."""

    dag: Dag
    spec: ModelSpec
    n_tokens: int
    n_seqs: int
    n_outputs: int
    n_kv: int
    n_kv_swa: int
    flash_attn: bool
    type_k: str
    type_v: str
    header: dict = field(default_factory=dict)   # the GGUF's metadata ({arch}.ssm.* and the like)
    _inputs: dict = field(default_factory=dict)

    @property
    def n_seq_tokens(self) -> int:
        return self.n_tokens // self.n_seqs

    def input(self, name: str, shape, esize: int) -> int:
        """One graph input, created once (llama.cpp's ``llm_graph_input_*``)."""
        if name not in self._inputs:
            self._inputs[name] = self.dag.input(shape, esize)
        return self._inputs[name]

    def has(self, il: int, name: str) -> bool:
        return self.spec.tensor(f"blk.{il}.{name}") is not None


def embeddings(u: Ubatch, scale: bool = False) -> int:
    """build_inp_embd: the token rows of the embedding matrix and the float-embeddings input, both in the graph
    (``ggml_build_forward_select`` picks one), the rows scaled by ``embedding_scale`` when set; expanded."""
    d, T, E = u.dag, u.n_tokens, u.spec.n_embd
    rows = d.f32("GET_ROWS", (E, T), d.weight(), u.input("tokens", (T,), I32))
    d.expand(rows)
    d.expand(d.input((E, T), F32))
    if scale:
        rows = d.f32("SCALE", (E, T), rows)
        d.expand(rows)
    return rows


def rms_norm(u: Ubatch, x: int, weight: bool = True) -> int:
    """build_norm(LLM_NORM_RMS): RMS_NORM, then MUL by the weight."""
    d = u.dag
    t = d.f32("RMS_NORM", d.shape[x], x)
    return d.f32("MUL", d.shape[x], t, d.weight()) if weight else t


def matmul(u: Ubatch, x: int, n_out: int) -> int:
    """build_lora_mm: weight × x, rows of ``n_out``."""
    d = u.dag
    return d.f32("MUL_MAT", (n_out,) + d.shape[x][1:], d.weight(), x)


def build_rs(u: Ubatch, cache: int, state_size: int, rows=None) -> int:
    """build_rs: clear one state in place, gather the ubatch's sequences' rows ([state_size, n_seqs]; or
    ``rows(states, ids)``, Mamba-2's scan reading them itself), copy the extra rows (none in the worst case).
    Each step is expanded at once, as llama.cpp does."""
    d, ns = u.dag, u.n_seqs
    s_copy = u.input("s_copy", (ns,), I32)
    main = u._inputs.setdefault("s_copy_main", d.view(s_copy, (ns,)))
    extra = u._inputs.setdefault("s_copy_extra", d.view(s_copy, (0,)))
    states = d.view(cache, (state_size, ns))
    d.expand(d.into("SCALE", states, d.view(states, (state_size,))))
    rows = d.f32("GET_ROWS", (state_size, ns), states, main) if rows is None else rows(states, main)
    d.expand(rows)
    spare = d.f32("GET_ROWS", (state_size, 0), states, extra)
    d.expand(d.into("CPY", cache, spare, d.view(cache, (state_size, 0))))
    return rows


def _hadamard(u: Ubatch, x: int, rot: int, n: int) -> int:
    """llama_mul_mat_hadamard (llama-impl.h): x reshaped to rows of ``n`` times the rotation (llama.cpp copies a
    non-contiguous x first; every x rotated here is contiguous: a rope result, a projection, the attention)."""
    d = u.dag
    shape = d.shape[x]
    numel = prod(shape)
    rows = d.view(x, (n, numel // n))
    return d.view(d.f32("MUL_MAT", (n, numel // n), rot, rows), shape)


def attention(u: Ubatch, il: int, q: int, k: int, v: int, *, swa: bool = False) -> int:
    """build_attn (KV cache) + build_attn_mha: q [hd, H, T], k [hd, Hkv, T], v [hdv, Hkv, T] -> [hdv·H, T]
    before the output projection."""
    d, spec, T, ns = u.dag, u.spec, u.n_tokens, u.n_seqs
    hd, H = d.dim(q, 0), d.dim(q, 1)
    hdv, Hkv = d.dim(v, 0), d.dim(v, 1)
    n_kv = u.n_kv_swa if swa else u.n_kv
    rot_k = attn_rotation(hd, u.type_k)
    rot_v = 64 if attn_rotation(hdv, u.type_v) else 0
    if rot_k:
        kr = u.input("k_rot", (rot_k, rot_k), F32)
        q, k = _hadamard(u, q, kr, rot_k), _hadamard(u, k, kr, rot_k)
    if rot_v:
        v = _hadamard(u, v, u.input("v_rot", (rot_v, rot_v), F32), rot_v)
    d.expand(q)
    d.expand(v)
    d.expand(k)
    key = "swa" if swa else "kv"
    kv_all = max((b for _, b in spec.kv_dims), default=0)   # n_embd_v_gqa_max: the transposed V's indices
    k_idx = u.input(f"{key}_k_idxs", (T,), I64)
    kc, vc = d.cache(), d.cache()
    d.expand(d.into("SET_ROWS", kc, d.view(k, (Hkv * hd, T)), k_idx, kc))
    if u.flash_attn:
        v_idx = u.input(f"{key}_v_idxs", (T,), I64)
        d.expand(d.into("SET_ROWS", vc, d.view(v, (Hkv * hdv, T)), v_idx, vc))
    else:
        v_idx = u.input(f"{key}_v_idxs", (max(kv_all, Hkv * hdv) * T,), I64)
        vr = d.view(d.view(v, (Hkv * hdv, T)), (1, Hkv * hdv * T))
        d.expand(d.into("SET_ROWS", vc, vr, v_idx, d.view(vc, (1,), contiguous=False)))
    mask = u.input(f"{key}_mask", (n_kv, T), F16 if u.flash_attn else F32)
    tq = T // ns
    qp = d.view(d.view(q, (hd, H, tq, ns)), (hd, tq, H, ns), contiguous=False)
    kp = d.view(d.view(kc, (hd, Hkv, n_kv, ns), contiguous=False), (hd, n_kv, Hkv, ns), contiguous=False)
    if u.flash_attn:
        vp = d.view(d.view(vc, (hdv, Hkv, n_kv, ns), contiguous=False), (hdv, n_kv, Hkv, ns), contiguous=False)
        a = d.f32("FLASH_ATTN_EXT", (hdv, H, tq, ns), qp, kp, vp, mask)
        a = d.view(a, (hdv * H, T))
    else:
        vp = d.view(d.view(vc, (n_kv, Hkv, hdv, ns), contiguous=False), (n_kv, hdv, Hkv, ns), contiguous=False)
        kq = d.f32("MUL_MAT", (n_kv, tq, H, ns), kp, qp)
        kq = d.f32("SOFT_MAX", (n_kv, tq, H, ns), kq, mask)
        kqv = d.f32("MUL_MAT", (hdv, tq, H, ns), vp, kq)
        a = d.f32("CONT", (hdv * H, T), d.view(kqv, (hdv, H, tq, ns), contiguous=False))
    d.expand(a)
    if rot_v:
        a = _hadamard(u, a, u.input("v_rot", (rot_v, rot_v), F32), rot_v)
    return a


def ffn(u: Ubatch, x: int, n_ff: int, gated: bool = True, act: str = "GLU") -> int:
    """build_ffn: LLM_FFN_PAR gate and up, SwiGLU, down (``gated`` False: up, the activation, down)."""
    d = u.dag
    R = d.shape[x][1:]
    if gated:
        gate = matmul(u, x, n_ff)
        up = matmul(u, x, n_ff)
        h = d.f32("GLU", (n_ff,) + R, gate, up)
    else:
        h = d.f32(act, (n_ff,) + R, matmul(u, x, n_ff))
    return matmul(u, h, u.spec.n_embd)


def moe(u: Ubatch, x: int, n_expert: int, n_used: int, ff: int, gating: str = "SOFT_MAX",
        norm_w: bool = True, w_scale: float = 0.0, probs_bias: bool = False, logits: int | None = None,
        gated: bool = True) -> int:
    """build_moe_ffn: router logits (or ``logits`` computed by the caller), softmax or sigmoid probabilities
    (selected through ``exp_probs_b`` when ``probs_bias``), top-k by argsort, the chosen weights (normalised to
    sum 1 when ``norm_w``, scaled by ``w_scale``), up (and gate: SwiGLU; else ReLU²) and down through MUL_MAT_ID,
    weighted and summed over the experts.  The weights, the experts and each partial sum are expanded early."""
    d = u.dag
    E, R = d.dim(x, 0), d.dim(x, 1)
    lg = matmul(u, x, n_expert) if logits is None else logits
    pr = d.f32("SOFT_MAX" if gating == "SOFT_MAX" else "UNARY", (n_expert, R), lg)
    sel = d.f32("ADD", (n_expert, R), pr, d.weight()) if probs_bias else pr
    prr = d.view(pr, (1, n_expert, R))
    srt = d.op("ARGSORT", (n_expert, R), I32, sel)
    top = d.view(srt, (n_used, R), contiguous=False)
    wt = d.f32("GET_ROWS", (1, n_used, R), prr, top)
    if norm_w:
        wtr = d.view(wt, (n_used, R))
        sm = d.f32("SUM_ROWS", (1, R), wtr)
        sm = d.f32("CLAMP", (1, R), sm)
        wt = d.view(d.f32("DIV", (n_used, R), wtr, sm), (1, n_used, R))
    if w_scale not in (0.0, 1.0):
        wt = d.f32("SCALE", (1, n_used, R), wt)
    d.expand(wt)                          # "call early so that topk-moe can be used"
    xr = d.view(x, (E, 1, R))
    up = d.f32("MUL_MAT_ID", (ff, n_used, R), d.weight(), xr, top)
    if gated:
        gt = d.f32("MUL_MAT_ID", (ff, n_used, R), d.weight(), xr, top)
        h = d.f32("GLU", (ff, n_used, R), gt, up)
    else:
        h = d.f32("SQR", (ff, n_used, R), d.f32("UNARY", (ff, n_used, R), up))
    dn = d.f32("MUL_MAT_ID", (E, n_used, R), d.weight(), h, top)
    wd = d.f32("MUL", (E, n_used, R), dn, wt)
    d.expand(wd)
    views = [d.view(wd, (E, R), contiguous=False) for _ in range(n_used)]
    for vw in views:
        d.expand(vw)
    out = views[0]
    for vw in views[1:]:
        out = d.f32("ADD", (E, R), out, vw)
        d.expand(out)
    return out if n_used > 1 else d.f32("CONT", (E, R), out)


def out_rows(u: Ubatch, x: int) -> int:
    """build_inp_out_ids + ggml_get_rows: the rows that produce logits."""
    d = u.dag
    ids = u.input("out_ids", (u.n_outputs,), I32)
    return d.f32("GET_ROWS", (d.shape[x][0], u.n_outputs), x, ids)


def head(u: Ubatch, x: int, *, norm_is_output: bool = False) -> int:
    """The output norm (an output tensor itself when ``norm_is_output``), the logit rows, the LM head."""
    d = u.dag
    t = d.f32("RMS_NORM", d.shape[x], x)
    t = d.op("MUL", d.shape[x], F32, t, d.weight(), output=norm_is_output)
    return logits(u, t)


def logits(u: Ubatch, x: int) -> int:
    d = u.dag
    d.g.flags[x] |= 2
    out = d.op("MUL_MAT", (u.spec.vocab_size, d.dim(x, 1)), F32, d.weight(), x, output=True)
    d.expand(out)
    return out
