"""Mamba graphs: mamba, mamba2 (every layer), granitehybrid and nemotron_h (Mamba-2 layers beside attention).

Follows src/models/mamba-base.cpp ``build_mamba2_layer`` and ``build_mamba_layer``, mamba.cpp, granite-hybrid.cpp and nemotron-h.cpp.
A Mamba-2 layer: the conv rows gathered (``build_rs``); ssm_in gives z | xBC | dt; xBC transposed after the
conv rows (CONCAT), the last d_conv-1 columns copied back; ``ssm_conv`` + bias + silu; dt + bias; the
SSM_SCAN runs inside ``build_rs`` on the gathered states (its result: y, then the new states, copied back);
y + x·D, SwiGLU with z, a grouped RMS norm, ssm_out.  The ubatch's n_seqs sizes the conv rows and states.
Granite layers: the residual (× ``residual_scale``) then ``ffn_norm`` and a dense or MoE FFN (softmax
gating, plus a shared expert); RoPE only with ``rope.scaling.finetuned`` (its default true); the logit rows are
taken in the last layer; the LM head scaled by 1/``logit_scale``.  Nemotron-H layers are Mamba-2, attention or a
ReLU² FFN (nemotron_h_moe: sigmoid-gated ReLU² experts, on a latent projection when the file has one, plus a
shared expert); the output norm is an output tensor (the NextN head's), the logit rows are taken after it.
"""

from __future__ import annotations

from localinfer.backends.llamacpp import hybrid_blocks as hb
from localinfer.backends.llamacpp.hybrid_blocks import F32, Ubatch


def _kv(u: Ubatch, key: str, default=None):
    return u.header.get(f"{u.spec.arch}.{key}", default)


def mamba2_layer(u: Ubatch, il: int, x: int) -> int:
    d, T, ns, tq = u.dag, u.n_tokens, u.n_seqs, u.n_seq_tokens
    d_conv, d_inner = _kv(u, "ssm.conv_kernel"), _kv(u, "ssm.inner_size")
    d_state, nh, ng = _kv(u, "ssm.state_size"), _kv(u, "ssm.time_step_rank"), _kv(u, "ssm.group_count")
    hd = d_inner // nh
    ch = d_inner + 2 * ng * d_state
    n_r, n_s = u.spec.rs_dims
    r_cache, s_cache = d.cache(), d.cache()
    conv = d.view(hb.build_rs(u, r_cache, n_r), (d_conv - 1, ch, ns))
    zx = d.view(hb.matmul(u, x, 2 * d_inner + 2 * ng * d_state + nh), (2 * d_inner + 2 * ng * d_state + nh, tq, ns))
    n_in = 2 * d_inner + 2 * ng * d_state + nh
    z = d.view(zx, (hd, nh, tq, ns), strides=(4 * hd, 4 * n_in, 4 * n_in * tq))
    xbc = d.view(zx, (ch, tq, ns), strides=(4 * n_in, 4 * n_in * tq))
    dt = d.view(zx, (nh, tq, ns), strides=(4 * n_in, 4 * n_in * tq))
    conv_x = d.f32("CONCAT", (d_conv - 1 + tq, ch, ns), conv, d.view(xbc, (tq, ch, ns), contiguous=False))
    last = d.view(conv_x, (d_conv - 1, ch, ns), contiguous=False)
    d.expand(d.into("CPY", r_cache, last, d.view(r_cache, (n_r, ns))))
    xbc = d.f32("SSM_CONV", (ch, tq, ns), conv_x, d.weight())
    xbc = d.f32("UNARY", (ch, tq, ns), d.f32("ADD", (ch, tq, ns), xbc, d.weight()))
    xs = d.view(xbc, (hd, nh, tq, ns), contiguous=False)
    B = d.view(xbc, (d_state, ng, tq, ns), contiguous=False)
    C = d.view(xbc, (d_state, ng, tq, ns), contiguous=False)
    dt = d.f32("ADD", (nh, tq, ns), d.f32("CONT", (nh, tq, ns), dt), d.weight())
    A = d.weight()

    def scan(states, ids):
        ssm = d.view(states, (d_state, hd, nh, ns))
        return d.f32("SSM_SCAN", (d_inner * T + d_state * d_inner * ns,), ssm, xs, dt, A, B, C, ids)

    y_ssm = hb.build_rs(u, s_cache, n_s, scan)
    d.expand(d.into("CPY", s_cache, d.view(y_ssm, (n_s, ns), contiguous=False), d.view(s_cache, (n_s, ns))))
    y = d.view(y_ssm, (hd, nh, tq, ns))
    y = d.f32("ADD", (hd, nh, tq, ns), y, d.f32("MUL", (hd, nh, tq, ns), xs, d.weight()))
    y = d.f32("GLU", (hd, nh, tq, ns), d.f32("CONT", (hd, nh, tq, ns), z), y)
    if u.has(il, "ssm_norm.weight"):
        y = hb.rms_norm(u, d.view(y, (d_inner // ng, ng, tq, ns)))
    return hb.matmul(u, d.view(y, (d_inner, T)), u.spec.n_embd)


def mamba_layer(u: Ubatch, il: int, x: int) -> int:
    """build_mamba_layer (Mamba-1): one head per channel, dt | B | C from ssm_x, dt through ssm_dt."""
    d, T, ns, tq = u.dag, u.n_tokens, u.n_seqs, u.n_seq_tokens
    d_conv, d_inner = _kv(u, "ssm.conv_kernel"), _kv(u, "ssm.inner_size")
    d_state, dt_rank = _kv(u, "ssm.state_size"), _kv(u, "ssm.time_step_rank")
    n_r, n_s = u.spec.rs_dims
    r_cache, s_cache = d.cache(), d.cache()
    conv = d.view(hb.build_rs(u, r_cache, n_r), (d_conv - 1, d_inner, ns))
    xz = hb.matmul(u, d.view(x, (u.spec.n_embd, tq, ns)), 2 * d_inner)
    xs = d.view(xz, (d_inner, tq, ns), strides=(8 * d_inner, 8 * d_inner * tq))
    z = d.view(xz, (d_inner, tq, ns), strides=(8 * d_inner, 8 * d_inner * tq))
    conv_x = d.f32("CONCAT", (d_conv - 1 + tq, d_inner, ns), conv, d.view(xs, (tq, d_inner, ns), contiguous=False))
    last = d.view(conv_x, (d_conv - 1, d_inner, ns), contiguous=False)
    d.expand(d.into("CPY", r_cache, last, d.view(r_cache, (n_r * ns,))))
    xs = d.f32("SSM_CONV", (d_inner, tq, ns), conv_x, d.weight())
    xs = d.f32("UNARY", (d_inner, tq, ns), d.f32("ADD", (d_inner, tq, ns), xs, d.weight()))
    x_db = hb.matmul(u, xs, dt_rank + 2 * d_state)
    dt = d.view(x_db, (dt_rank, tq, ns), contiguous=False)
    B = d.view(x_db, (d_state, 1, tq, ns), contiguous=False)
    C = d.view(x_db, (d_state, 1, tq, ns), contiguous=False)
    if _kv(u, "ssm.dt_b_c_rms") or u.has(il, "ssm_dt_norm.weight"):
        dt, B, C = hb.rms_norm(u, dt), hb.rms_norm(u, B), hb.rms_norm(u, C)
    else:
        dt = d.f32("CONT", (dt_rank, tq, ns), dt)
    dt = d.f32("ADD", (d_inner, tq, ns), hb.matmul(u, dt, d_inner), d.weight())
    x4 = d.view(xs, (1, d_inner, tq, ns))
    A = d.weight()

    def scan(states, ids):
        ssm = d.view(states, (d_state, 1, d_inner, ns))
        return d.f32("SSM_SCAN", (d_inner * T + d_state * d_inner * ns,), ssm, x4, dt, A, B, C, ids)

    y_ssm = hb.build_rs(u, s_cache, n_s, scan)
    d.expand(d.into("CPY", s_cache, d.view(y_ssm, (n_s * ns,), contiguous=False), d.view(s_cache, (n_s * ns,))))
    y = d.view(y_ssm, (d_inner, tq, ns), contiguous=False)
    y = d.f32("ADD", (d_inner, tq, ns), y, d.f32("MUL", (d_inner, tq, ns), xs, d.weight()))
    y = d.f32("GLU", (d_inner, tq, ns), d.f32("CONT", (d_inner, tq, ns), z), y)
    return d.view(hb.matmul(u, y, u.spec.n_embd), (u.spec.n_embd, T))


def _qkv(u: Ubatch, il: int, x: int) -> tuple[int, int, int]:
    """build_qkv with separate projections (a bias added when present), reshaped to heads."""
    d, spec, T = u.dag, u.spec, u.n_tokens
    hd, H, Hkv = spec.head_dim_k, spec.n_head[il], spec.n_head_kv[il]
    out = []
    for name, n in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * spec.head_dim_v)):
        t = hb.matmul(u, x, n)
        if u.has(il, f"attn_{name}.bias"):
            t = d.f32("ADD", (n, T), t, d.weight())
        out.append(t)
    q, k, v = out
    return d.view(q, (hd, H, T)), d.view(k, (hd, Hkv, T)), d.view(v, (spec.head_dim_v, Hkv, T))


def attention_layer(u: Ubatch, il: int, x: int, rope: bool) -> int:
    d, T = u.dag, u.n_tokens
    q, k, v = _qkv(u, il, x)
    if rope:
        pos = u.input("pos", (T,), 4)
        extra = (d.weight(),) if u.spec.tensor("rope_freqs.weight") is not None else ()
        q = d.f32("ROPE", d.shape[q], q, pos, *extra)
        k = d.f32("ROPE", d.shape[k], k, pos, *extra)
    a = hb.attention(u, il, q, k, v)
    a = hb.matmul(u, a, u.spec.n_embd)
    if u.has(il, "attn_output.bias"):
        a = d.f32("ADD", d.shape[a], a, d.weight())
    return a


def _relu2_ffn(u: Ubatch, il: int, x: int, n_ff: int) -> int:
    """build_ffn(LLM_FFN_RELU_SQR): up (+ bias), ReLU, square, down (+ bias)."""
    d = u.dag
    h = hb.matmul(u, x, n_ff)
    if u.has(il, "ffn_up.bias"):
        h = d.f32("ADD", d.shape[h], h, d.weight())
    h = d.f32("SQR", d.shape[h], d.f32("UNARY", d.shape[h], h))
    out = hb.matmul(u, h, u.spec.n_embd)
    if u.has(il, "ffn_down.bias"):
        out = d.f32("ADD", d.shape[out], out, d.weight())
    return out


def _latent_moe(u: Ubatch, il: int, x: int) -> int:
    """nemotron-h.cpp ``build_ffn_layer`` with experts: router logits from x, sigmoid gating through
    ``exp_probs_b``, the experts (ReLU², no gate) on the latent projection when there is one, plus the
    ReLU² shared expert."""
    d, spec = u.dag, u.spec
    E, R = spec.n_embd, d.dim(x, 1)
    latent = x
    if u.has(il, "ffn_latent_down.weight"):
        latent = hb.matmul(u, x, spec.tensor(f"blk.{il}.ffn_latent_down.weight").shape[1])
    logits = hb.matmul(u, x, spec.n_expert)
    ff = spec.tensor(f"blk.{il}.ffn_up_exps.weight").shape[1]
    out = hb.moe(u, latent, spec.n_expert, spec.n_expert_used, ff, gating="SIGMOID",
                 norm_w=bool(_kv(u, "expert_weights_norm", False)),
                 w_scale=float(_kv(u, "expert_weights_scale", 0.0) or 0.0), probs_bias=True, logits=logits,
                 gated=False)
    if u.has(il, "ffn_latent_up.weight"):
        out = hb.matmul(u, out, E)
    shared = _relu2_ffn(u, il, x, spec.tensor(f"blk.{il}.ffn_up_shexp.weight").shape[1])
    return d.f32("ADD", (E, R), out, shared)


def _granite(u: Ubatch) -> None:
    d, spec = u.dag, u.spec
    E, T, O = spec.n_embd, u.n_tokens, u.n_outputs
    rope = bool(_kv(u, "rope.scaling.finetuned", True))
    res_scale = float(_kv(u, "residual_scale", 0.0) or 0.0)
    cur = hb.embeddings(u, scale=bool(_kv(u, "embedding_scale")))
    last = spec.n_layers - 1
    for il in range(spec.n_layers):
        d.g.unit = il
        inp = cur
        x = hb.rms_norm(u, cur)
        cur = mamba2_layer(u, il, x) if spec.recurrent[il] else attention_layer(u, il, x, rope)
        R = O if il == last else T
        if il == last:
            cur, inp = hb.out_rows(u, cur), hb.out_rows(u, inp)
        if res_scale:
            cur = d.f32("SCALE", (E, R), cur)
        f_in = d.f32("ADD", (E, R), cur, inp)
        h = hb.rms_norm(u, f_in)
        if u.has(il, "ffn_gate_inp.weight"):
            f = hb.moe(u, h, spec.n_expert, spec.n_expert_used, spec.expert_ff or spec.n_ff[il],
                       w_scale=float(_kv(u, "expert_weights_scale", 0.0) or 0.0))
            if u.has(il, "ffn_up_shexp.weight"):
                f = d.f32("ADD", (E, R), f, hb.ffn(u, h, spec.tensor(f"blk.{il}.ffn_up_shexp.weight").shape[1]))
        else:
            f = hb.ffn(u, h, spec.n_ff[il])
        if res_scale:
            f = d.f32("SCALE", (E, R), f)
        cur = d.f32("ADD", (E, R), f, f_in)
    d.g.unit = "out"
    x = hb.rms_norm(u, cur)
    d.g.flags[x] |= 2
    out = d.op("MUL_MAT", (spec.vocab_size, O), F32, d.weight(), x, output=not _kv(u, "logit_scale"))
    if _kv(u, "logit_scale"):
        out = d.op("SCALE", (spec.vocab_size, O), F32, out, output=True)
    d.expand(out)


def _mamba2(u: Ubatch) -> None:
    d, spec = u.dag, u.spec
    E, T, O = spec.n_embd, u.n_tokens, u.n_outputs
    cur = hb.embeddings(u)
    last = spec.n_layers - 1
    for il in range(spec.n_layers):
        d.g.unit = il
        inp = cur
        layer = mamba2_layer if spec.arch == "mamba2" else mamba_layer
        cur = layer(u, il, hb.rms_norm(u, cur))
        if il == last:
            cur, inp = hb.out_rows(u, cur), hb.out_rows(u, inp)
        cur = d.f32("ADD", (E, O if il == last else T), cur, inp)
    d.g.unit = "out"
    x = hb.rms_norm(u, cur)
    hb.logits(u, x)


def _nemotron(u: Ubatch) -> None:
    d, spec = u.dag, u.spec
    E, T = spec.n_embd, u.n_tokens
    cur = hb.embeddings(u)
    for il in range(spec.n_layers):
        d.g.unit = il
        inp = cur
        x = hb.rms_norm(u, cur)
        if spec.recurrent[il]:
            cur = mamba2_layer(u, il, x)
        elif spec.n_ff[il] == 0:
            cur = attention_layer(u, il, x, rope=False)
        elif u.has(il, "ffn_gate_inp.weight"):
            cur = _latent_moe(u, il, x)
        else:
            cur = _relu2_ffn(u, il, x, spec.n_ff[il])
        cur = d.f32("ADD", (E, T), cur, inp)
    d.g.unit = "out"
    x = hb.rms_norm(u, cur)
    d.g.flags[x] |= 2
    hb.logits(u, hb.out_rows(u, x))


def graph(u: Ubatch) -> None:
    {"mamba": _mamba2, "mamba2": _mamba2, "granitehybrid": _granite}.get(u.spec.arch, _nemotron)(u)
