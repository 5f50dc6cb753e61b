"""The short-convolution hybrids' graph: lfm2, lfm2moe (src/models/lfm2.cpp; lfm2moe.cpp loads the experts).

A conv layer: in_proj gives b | c | x; b·x transposed after the conv rows gathered by ``build_rs`` (CONCAT),
the last ``l_cache - 1`` columns copied back; ``ssm_conv``; c times the result; out_proj.  An attention layer:
q/k/v projected and reshaped, q/k RMS-normed and roped, ``build_attn`` with the output projection (sliding
window when the file sets one: every attention layer slides).  Every layer: the residual (previous + block),
``ffn_norm``, a dense FFN (the first ``leading_dense_block_count`` layers of lfm2moe) or the experts; the logit
rows are taken in the last layer.
"""

from __future__ import annotations

from localinfer.backends.llamacpp import hybrid_blocks as hb
from localinfer.backends.llamacpp.graph_mamba2 import _qkv
from localinfer.backends.llamacpp.hybrid_blocks import Ubatch


def _kv(u: Ubatch, key: str, default=None):
    return u.header.get(f"{u.spec.arch}.{key}", default)


def _shortconv(u: Ubatch, il: int, x: int) -> int:
    d, T, ns, tq, E = u.dag, u.n_tokens, u.n_seqs, u.n_seq_tokens, u.spec.n_embd
    d_conv = _kv(u, "shortconv.l_cache") - 1
    bcx = hb.matmul(u, d.view(x, (E, tq, ns)), 3 * E)
    b = d.view(bcx, (E, tq, ns), contiguous=False)
    c = d.view(bcx, (E, tq, ns), contiguous=False)
    xs = d.view(bcx, (E, tq, ns), contiguous=False)
    bx = d.view(d.f32("MUL", (E, tq, ns), b, xs), (tq, E, ns), contiguous=False)
    r_cache = d.cache()
    n_r = u.spec.rs_dims[0]
    conv = d.view(hb.build_rs(u, r_cache, n_r), (d_conv, E, ns))
    bx = d.f32("CONCAT", (d_conv + tq, E, ns), conv, bx)
    d.expand(d.into("CPY", r_cache, d.view(bx, (d_conv, E, ns), contiguous=False), d.view(r_cache, (n_r, ns))))
    y = d.f32("MUL", (E, tq, ns), c, d.f32("SSM_CONV", (E, tq, ns), bx, d.weight()))
    return d.view(hb.matmul(u, y, E), (E, T))


def _attention(u: Ubatch, il: int, x: int) -> int:
    d, T = u.dag, u.n_tokens
    q, k, v = _qkv(u, il, x)
    pos = u.input("pos", (T,), 4)
    q = d.f32("ROPE", d.shape[q], hb.rms_norm(u, q), pos)
    k = d.f32("ROPE", d.shape[k], hb.rms_norm(u, k), pos)
    a = hb.attention(u, il, q, k, v, swa=bool(u.spec.has_swa and u.spec.swa_layers[il]))
    return hb.matmul(u, a, u.spec.n_embd)


def graph(u: Ubatch) -> None:
    d, spec = u.dag, u.spec
    E, T, O = spec.n_embd, u.n_tokens, u.n_outputs
    dense_lead = int(_kv(u, "leading_dense_block_count", 0) or 0) if spec.n_expert else spec.n_layers
    cur = hb.embeddings(u)
    last = spec.n_layers - 1
    for il in range(spec.n_layers):
        d.g.unit = il
        prev = cur
        x = hb.rms_norm(u, cur)
        cur = _shortconv(u, il, x) if spec.recurrent[il] else _attention(u, il, x)
        if il == last:
            cur, prev = hb.out_rows(u, cur), hb.out_rows(u, prev)
        R = O if il == last else T
        cur = d.f32("ADD", (E, R), prev, cur)
        h = hb.rms_norm(u, cur)
        if il >= dense_lead:
            f = hb.moe(u, h, spec.n_expert, spec.n_expert_used, spec.expert_ff or spec.n_ff[il],
                       gating="SIGMOID" if _kv(u, "expert_gating_func", 1) == 2 else "SOFT_MAX",
                       probs_bias=u.has(il, "exp_probs_b.bias"),
                       w_scale=float(_kv(u, "expert_weights_scale", 0.0) or 0.0))
        else:
            f = hb.ffn(u, h, spec.n_ff[il])
        cur = d.f32("ADD", (E, R), cur, f)
    d.g.unit = "out"
    hb.logits(u, hb.rms_norm(u, cur))
