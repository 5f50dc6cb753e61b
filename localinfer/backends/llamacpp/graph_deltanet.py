"""The gated delta-net hybrids' graph: qwen35, qwen35moe, qwen3next (three linear layers per attention layer).

Follows src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp and delta-net-base.cpp.  A linear layer:
qkv and the z gate projected from the normed input (legacy qwen3next files: one ``ssm_in`` split per key head,
copied and concatenated); beta = sigmoid, gate = softplus(alpha + dt) · a;
``build_conv_state`` (the conv rows gathered by ``build_rs``, concatenated before the transposed qkv, the
last K-1 columns copied back to the cache); ``ssm_conv`` + silu; q and k L2-normed (RMS_NORM + SCALE) and,
for qwen3next, repeated to the value heads; one fused GATED_DELTA_NET (the CPU backend has it, so
``resolve_fused_ops`` keeps it on) whose result holds the output and then the new state, copied back;
the gated RMS norm, the out projection.  An attention layer: the query projected with its gate (2 × head),
q/k RMS-normed and roped, ``build_attn``, times sigmoid(gate).  Every layer then adds the residual, applies
``post_attention_norm`` and the FFN (dense, or the experts plus a sigmoid-gated shared expert).  The output
norm is an output tensor of its own (the NextN head reads it); the logit rows are taken after it.
"""

from __future__ import annotations

from localinfer.backends.llamacpp import hybrid_blocks as hb
from localinfer.backends.llamacpp.hybrid_blocks import Ubatch

ARCHS = ("qwen35", "qwen35moe", "qwen3next")


def ssm_dims(u: Ubatch) -> dict:
    """{arch}.ssm.*: conv kernel, d_inner, head_k_dim (state_size), k heads (group_count), v heads
    (time_step_rank) — llama-model.cpp load_hparams for these archs."""
    kv = u.header
    a = u.spec.arch
    return {"d_conv": kv[f"{a}.ssm.conv_kernel"], "d_inner": kv[f"{a}.ssm.inner_size"],
            "hk": kv[f"{a}.ssm.state_size"], "Hk": kv[f"{a}.ssm.group_count"], "Hv": kv[f"{a}.ssm.time_step_rank"]}


def _linear(u: Ubatch, il: int, x: int) -> int:
    d, T, ns, tq = u.dag, u.n_tokens, u.n_seqs, u.n_seq_tokens
    s = ssm_dims(u)
    hk, Hk, Hv, d_inner = s["hk"], s["Hk"], s["Hv"], s["d_inner"]
    hv = d_inner // Hv
    ch = d_inner + 2 * Hk * hk
    if u.has(il, "ssm_in.weight"):                     # legacy qwen3next files: q | k | v | z per key head
        per = 2 * hk + 2 * hv * (Hv // Hk)
        mixed = d.view(hb.matmul(u, x, per * Hk), (per, Hk, tq, ns))
        q, k, v, zv = (d.view(mixed, (n, Hk, tq, ns), contiguous=False) for n in (hk, hk, hv * Hv // Hk, hv * Hv // Hk))
        z = d.f32("CONT", (hv * Hv // Hk, Hk, tq, ns), zv)
        flat = [d.f32("CONT", (n, tq, ns), t) for n, t in ((hk * Hk, q), (hk * Hk, k), (d_inner, v))]
        qkv = d.f32("CONCAT", (ch, tq, ns), d.f32("CONCAT", (2 * hk * Hk, tq, ns), flat[0], flat[1]), flat[2])
    else:
        qkv = d.view(hb.matmul(u, x, ch), (ch, tq, ns))
        z = hb.matmul(u, x, d_inner)
    if u.has(il, "ssm_ba.weight"):                     # qwen3next: beta and alpha in one projection
        ba = d.view(hb.matmul(u, x, 2 * Hv), (2 * Hv // Hk, Hk, tq, ns))
        b = d.view(ba, (Hv // Hk, Hk, tq, ns), contiguous=False)
        a = d.view(ba, (Hv // Hk, Hk, tq, ns), contiguous=False)
        beta = d.f32("UNARY", (Hv // Hk, Hk, tq, ns), d.f32("CONT", (Hv // Hk, Hk, tq, ns), b))
        alpha = d.f32("CONT", (Hv, tq, ns), a)
    else:
        beta = d.f32("UNARY", (1, Hv, tq, ns), d.view(hb.matmul(u, x, Hv), (1, Hv, tq, ns)))
        alpha = d.view(hb.matmul(u, x, Hv), (Hv, tq, ns))
    gate = d.f32("MUL", (Hv, tq, ns), d.f32("UNARY", (Hv, tq, ns), d.f32("ADD", (Hv, tq, ns), alpha, d.weight())),
                 d.weight())
    beta = d.view(beta, (1, Hv, tq, ns))
    gate = d.view(gate, (1, Hv, tq, ns))
    r_cache, s_cache = d.cache(), d.cache()
    n_r, n_s = u.spec.rs_dims
    conv = d.view(hb.build_rs(u, r_cache, n_r), (s["d_conv"] - 1, ch, ns))
    conv_in = d.f32("CONCAT", (s["d_conv"] - 1 + tq, ch, ns), conv, d.view(qkv, (tq, ch, ns), contiguous=False))
    last = d.view(conv_in, (s["d_conv"] - 1, ch, ns), contiguous=False)
    d.expand(d.into("CPY", r_cache, last, d.view(r_cache, (n_r, ns))))
    state = d.view(hb.build_rs(u, s_cache, n_s), (hv, hv, Hv, ns))
    mixed = d.f32("UNARY", (ch, tq, ns), d.f32("SSM_CONV", (ch, tq, ns), conv_in, d.weight()))
    qc = d.view(mixed, (hk, Hk, tq, ns), contiguous=False)
    kc = d.view(mixed, (hk, Hk, tq, ns), contiguous=False)
    vc = d.view(mixed, (hv, Hv, tq, ns), contiguous=False)
    qc = d.f32("SCALE", (hk, Hk, tq, ns), d.f32("RMS_NORM", (hk, Hk, tq, ns), qc))
    kc = d.f32("SCALE", (hk, Hk, tq, ns), d.f32("RMS_NORM", (hk, Hk, tq, ns), kc))
    if u.spec.arch == "qwen3next" and Hk != Hv:        # repeat-interleave to the value heads
        qc = d.view(d.f32("REPEAT", (hk, Hv // Hk, Hk, tq * ns), d.view(qc, (hk, 1, Hk, tq * ns))), (hk, Hv, tq, ns))
        kc = d.view(d.f32("REPEAT", (hk, Hv // Hk, Hk, tq * ns), d.view(kc, (hk, 1, Hk, tq * ns))), (hk, Hv, tq, ns))
    gdn = d.f32("GATED_DELTA_NET", (hv * Hv, T + hv * ns), qc, kc, vc, gate, beta, state)
    out = d.view(gdn, (hv, Hv, tq, ns), contiguous=False)
    new_state = d.view(gdn, (hv, hv, Hv, ns), contiguous=False)
    d.expand(d.into("CPY", s_cache, new_state, d.view(s_cache, (n_s, ns))))
    normed = hb.rms_norm(u, out)
    gated = d.f32("MUL", (hv, Hv, tq, ns), normed, d.f32("UNARY", (hv, Hv, tq, ns), d.view(z, (hv, Hv, tq, ns))))
    y = hb.matmul(u, d.view(gated, (hv * Hv, tq, ns)), u.spec.n_embd)
    return d.view(y, (u.spec.n_embd, T))


def _attention(u: Ubatch, il: int, x: int) -> int:
    d, T, spec = u.dag, u.n_tokens, u.spec
    hd, H, Hkv = spec.head_dim_k, spec.n_head[il], spec.n_head_kv[il]
    pos = u.input("pos", (T,), 4 * (4 if spec.arch.startswith("qwen35") else 1))
    qf = hb.matmul(u, x, 2 * hd * H)
    if spec.arch == "qwen3next":
        qf = d.view(qf, (2 * hd, H, T))
    q = d.view(qf, (hd, H, T), contiguous=False)
    g = d.view(qf, (hd, H, T), contiguous=False)
    k = hb.matmul(u, x, hd * Hkv)
    v = hb.matmul(u, x, hd * Hkv)
    if spec.arch != "qwen3next":
        q = d.f32("ROPE", (hd, H, T), hb.rms_norm(u, q), pos)
        k = d.f32("ROPE", (hd, Hkv, T), hb.rms_norm(u, d.view(k, (hd, Hkv, T))), pos)
        v = d.view(v, (hd, Hkv, T))
    else:
        k = d.view(k, (hd, Hkv, T))
        v = d.view(v, (hd, Hkv, T))
        q = d.f32("ROPE", (hd, H, T), hb.rms_norm(u, q), pos)
        k = d.f32("ROPE", (hd, Hkv, T), hb.rms_norm(u, k), pos)
    a = hb.attention(u, il, q, k, v)
    gate = d.f32("UNARY", (hd * H, T), d.f32("CONT", (hd * H, T), g))
    return hb.matmul(u, d.f32("MUL", (hd * H, T), a, gate), spec.n_embd)


def _ffn(u: Ubatch, il: int, x: int) -> int:
    d, spec = u.dag, u.spec
    if not u.has(il, "ffn_gate_inp.weight"):
        return hb.ffn(u, x, spec.n_ff[il])
    out = hb.moe(u, x, spec.n_expert, spec.n_expert_used, spec.expert_ff or spec.n_ff[il],
                 w_scale=float(u.header.get(f"{spec.arch}.expert_weights_scale", 0.0)))
    if not u.has(il, "ffn_up_shexp.weight"):
        return out
    sh_ff = spec.tensor(f"blk.{il}.ffn_up_shexp.weight").shape[1]
    shared = hb.ffn(u, x, sh_ff)
    sg = d.f32("UNARY", (1,) + d.shape[x][1:], hb.matmul(u, x, 1))
    return d.f32("ADD", d.shape[out], out, d.f32("MUL", d.shape[shared], shared, sg))


def graph(u: Ubatch) -> None:
    d, spec = u.dag, u.spec
    E = spec.n_embd
    cur = hb.embeddings(u)
    for il in range(spec.n_layers):
        d.g.unit = il
        inp = cur
        x = hb.rms_norm(u, cur)
        d.expand(x)
        cur = _linear(u, il, x) if spec.recurrent[il] else _attention(u, il, x)
        res = d.f32("ADD", (E, u.n_tokens), cur, inp)
        cur = d.f32("ADD", (E, u.n_tokens), _ffn(u, il, hb.rms_norm(u, res)), res)
    d.g.unit = "out"
    x = hb.rms_norm(u, cur)
    d.g.flags[x] |= 2
    hb.logits(u, hb.out_rows(u, x))
