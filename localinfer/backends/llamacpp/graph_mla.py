"""The deepseek2 graph (multi-head latent attention) for :mod:`.compute_buffer`'s allocator replay.

It follows ``src/models/deepseek2.cpp`` (``graph::graph``) and ``src/llama-graph.cpp``:

* MLA layout (``attn_k_b``/``attn_v_b``): the query (``attn_q``, or ``attn_q_a`` → RMS norm → ``attn_q_b``)
  is split into its nope and rope parts; the nope part is absorbed through ``wk_b`` (a batched matmul per head)
  and concatenated with the roped part; the cache holds one latent per token (``kv_cmpr`` ‖ roped ``k_pe``),
  written by ``build_attn(llm_graph_input_attn_k)`` with no V cache: V is a view of the first kv_lora_rank
  values of K.  With flash attention the result (kv_lora_rank per head) is decompressed by ``wv_b`` between
  two permutes and made contiguous; without, ``kq`` → softmax → ``v`` (a contiguous transposed copy of the V
  view, in the cache type) → ``kqv`` → ``wv_b``, then one contiguous copy;
* legacy layout (an unsplit ``attn_kv_b``): plain multi-head attention over ``kv_b``'s split (a contiguous
  V, K = nope ‖ the shared roped ``k_pe`` repeated per head), through ``build_attn(llm_graph_input_attn_kv)``,
  with the Hadamard rotations of a quantized cache as any attention layer;
* ``attention.temperature_scale`` (Mistral-Large): the query times a per-token input before the attention;
* FFN: the first ``leading_dense_block_count`` layers dense, the others ``build_moe_ffn`` (softmax unless
  ``expert_gating_func`` says otherwise, ``exp_probs_b`` when present, ``expert_weights_norm`` /
  ``expert_weights_scale`` as written) plus the shared experts' dense FFN, added.

Nodes come in ggml's depth-first order: ``build_attn`` expands Q, then V, then K before the cache writes.
"""

from __future__ import annotations

from localinfer.backends.llamacpp.compute_buffer import F16, F32, I32, I64, _Graph, attn_rotation
from localinfer.backends.llamacpp.graph_ffn import SOFTMAX, dense_ffn, moe_ffn
from localinfer.model.spec import ModelSpec

VERIFIED = ("deepseek2",)


def GRAPH(spec: ModelSpec, layers: list[int], n_kv: int, n_tokens: int, n_outputs: int, flash_attn: bool,
          n_kv_swa: int, type_k: str = "f16", type_v: str = "f16", n_stream: int = 1, n_seqs: int = 1) -> _Graph:
    """The node sequence llama.cpp builds for one ubatch of a deepseek2 model (``_llama_graph``'s signature,
    ``n_stream`` the KV streams)."""
    if spec.mla is None:
        raise ValueError("deepseek2 graph without MLA sizes")
    g = _Graph()
    E, T, O = spec.n_embd, n_tokens, n_outputs
    is_mla = spec.kv_dims[0][1] == 0          # hparams.is_mla(): key/value_length_mla set, one latent, no V cache
    legacy_rot = (attn_rotation(spec.head_dim_k, type_k), 64 if attn_rotation(spec.head_dim_v, type_v) else 0)
    rot_k, rot_v = legacy_rot if not is_mla else (0, 0)
    tokens = g.leaf(T * I32, (T,), 1)
    g.leaf(E * T * F32, (E, T), 1)                 # inp_embd: created, never used, never freed
    pos = g.leaf(T * I32, (T,), 1)
    k_rot = g.leaf(rot_k * rot_k * F32, (rot_k, rot_k), 1) if rot_k else None
    v_rot = g.leaf(rot_v * rot_v * F32, (rot_v, rot_v), 1) if rot_v else None
    inputs: list[int] = []
    temp: list[int] = []           # inp_attn_scale (attention.temperature_scale): a leaf where first used

    def temperature(q: int, shape: tuple) -> int:
        if not spec.mla.temperature:
            return q
        if not temp:
            temp.append(g.leaf(T * F32, (1, 1, T), 1))
        return g.op_("MUL", shape, F32, q, temp[0])

    def kv_inputs() -> list[int]:
        if not inputs:               # k idxs [, v idxs], mask: created where first used (the leaf order)
            inputs.append(g.leaf(T * I64, (T,), 1))
            if not is_mla:
                v_all = max(spec.n_head_kv[il] * spec.head_dim_v for il in layers)
                inputs.append(g.leaf((T if flash_attn else v_all * T) * I64, (T,), 1))
            inputs.append(g.leaf(n_kv * T * (F16 if flash_attn else F32), (n_kv, T), 1))
        return inputs

    w = g.weight
    cur = g.op_("GET_ROWS", (E, T), F32, w(), tokens)
    last = layers[-1]
    gating = spec.routing.gating or SOFTMAX
    for il in layers:
        g.unit = il
        inp = cur
        x = g.op_("MUL", (E, T), F32, g.op_("RMS_NORM", (E, T), F32, inp), w())
        if is_mla:
            a = _mla_attention(g, spec, x, pos, kv_inputs, temperature, n_kv, T, flash_attn, n_stream, type_k)
        else:
            a = _legacy_attention(g, spec, x, pos, kv_inputs, temperature, n_kv, T, flash_attn, k_rot, v_rot, n_stream,
                                  type_k, type_v)
        R = T
        if il == last:
            out_ids = g.leaf(O * I32, (O,), 1)
            a = g.op_("GET_ROWS", (E, O), F32, a, out_ids)
            inp = g.op_("GET_ROWS", (E, O), F32, inp, out_ids)
            R = O
        res = g.op_("ADD", (E, R), F32, a, inp)
        x = g.op_("MUL", (E, R), F32, g.op_("RMS_NORM", (E, R), F32, res), w())
        if il < spec.routing.n_dense_lead or not spec.n_expert:
            f = dense_ffn(g, x, spec.n_ff[il], E, R)
        else:
            ff = spec.expert_ff or spec.n_ff[il]
            probs_bias = spec.tensor(f"blk.{il}.exp_probs_b.bias") is not None
            f = moe_ffn(g, x, n_embd=E, rows=R, n_expert=spec.n_expert, n_used=spec.n_expert_used, n_ff=ff,
                        routing=spec.routing, gating=gating, probs_bias=probs_bias)
            if spec.n_expert_shared:
                f = g.op_("ADD", (E, R), F32, f, dense_ffn(g, x, ff * spec.n_expert_shared, E, R))
        cur = g.op_("ADD", (E, R), F32, f, res)
    g.unit = "out"
    x = g.op_("MUL", (E, O), F32, g.op_("RMS_NORM", (E, O), F32, cur), w(), flags=2)
    g.op_("MUL_MAT", (spec.vocab_size, O), F32, w(), x, flags=2)
    return g


def _query(g: _Graph, spec: ModelSpec, x: int, T: int) -> tuple[int, int]:
    """The query matmul(s), reshaped to (head_dim_k, n_head, tokens), and n_head."""
    m, w = spec.mla, g.weight
    H = spec.n_head[0]
    if m.q_lora_rank and spec.tensor("blk.0.attn_q.weight") is None:    # is_lite: a plain attn_q
        q = g.op_("MUL_MAT", (m.q_lora_rank, T), F32, w(), x)
        q = g.op_("MUL", (m.q_lora_rank, T), F32, g.op_("RMS_NORM", (m.q_lora_rank, T), F32, q), w())
        q = g.op_("MUL_MAT", (H * m.head_dim_k, T), F32, w(), q)
    else:
        q = g.op_("MUL_MAT", (H * m.head_dim_k, T), F32, w(), x)
    return g.view(q, (m.head_dim_k, H, T)), H


def _compress(g: _Graph, spec: ModelSpec, x: int, T: int) -> tuple[int, int]:
    """kv_cmpr_pe = wkv_a_mqa · x and its RMS-normed kv_cmpr part."""
    m, w = spec.mla, g.weight
    pe = g.op_("MUL_MAT", (m.kv_lora_rank + m.n_rot, T), F32, w(), x)
    kv = g.view(pe, (m.kv_lora_rank, T), contiguous=False)
    kv = g.op_("MUL", (m.kv_lora_rank, T), F32, g.op_("RMS_NORM", (m.kv_lora_rank, T), F32, kv), w())
    return pe, kv


def _set_rows(g: _Graph, src: int, idx: int, cache: int) -> None:
    g.nodes.append(g._new(0, (), "SET_ROWS", (src, idx, cache), cache, 0, 4))


def _mla_attention(g, spec, x, pos, kv_inputs, temperature, n_kv, T, flash_attn, n_stream, type_k) -> int:
    m, w = spec.mla, g.weight
    r, rot = m.kv_lora_rank, m.n_rot
    nope = m.head_dim_k - rot
    q, H = _query(g, spec, x, T)
    q_nope = g.view(g.view(q, (nope, H, T), contiguous=False), (nope, T, H), contiguous=False)
    absorbed = g.view(g.op_("MUL_MAT", (r, T, H), F32, w(), q_nope), (r, H, T), contiguous=False)
    q_pe = g.op_("ROPE", (rot, H, T), F32, g.view(q, (rot, H, T), voff=nope * F32, contiguous=False), pos)
    qcur = temperature(g.op_("CONCAT", (r + rot, H, T), F32, absorbed, q_pe), (r + rot, H, T))
    pe, kv = _compress(g, spec, x, T)
    vcur = g.view(kv, (r, 1, T))
    k_pe = g.op_("ROPE", (rot, 1, T), F32, g.view(pe, (rot, 1, T), voff=r * F32, contiguous=False), pos)
    kcur = g.op_("CONCAT", (r + rot, 1, T), F32, vcur, k_pe)
    ins = kv_inputs()
    k_idx, mask = ins[0], ins[-1]
    kc = g.weight("kv")
    _set_rows(g, g.view(kcur, (r + rot, T)), k_idx, kc)
    k4 = g.view(kc, (r + rot, 1, n_kv), contiguous=False)
    if flash_attn:
        qp = g.view(g.view(qcur), (r + rot, T, H), contiguous=False)
        kp = g.view(k4, (r + rot, n_kv, 1), contiguous=False)
        vp = g.view(g.view(k4, (r, 1, n_kv), contiguous=False), (r, n_kv, 1), contiguous=False)
        if type_k == "f32":           # build_attn_mha: flash attention reads an f32 cache through f16 copies
            kp = g.op_("CPY", (r + rot, n_kv, 1, n_stream), F16, kp)
            vp = g.op_("CPY", (r, n_kv, 1, n_stream), F16, vp)
        a = g.op_("FLASH_ATTN_EXT", (r, H, T), F32, qp, kp, vp, mask)
        a = g.op_("MUL_MAT", (m.head_dim_v, T, H), F32, w(), g.view(a, (r, T, H), contiguous=False))
        a = g.op_("CONT", (m.head_dim_v, H, T), F32, g.view(a, (m.head_dim_v, H, T), contiguous=False))
        a = g.view(a, (m.head_dim_v * H, T))
    else:
        vv = g.view(g.view(g.view(k4, (r, 1, n_kv), contiguous=False), (r, n_kv, 1), contiguous=False),
                    (n_kv, r, 1), contiguous=False)
        esize = F32 if type_k == "f32" else F16   # the cache's type (a quantized one needs flash attention)
        v = g.op_("CONT", (n_kv, r, 1, n_stream), esize, vv)   # V transposed, one copy per stream
        kp = g.view(k4, (r + rot, n_kv, 1), contiguous=False)
        qp = g.view(g.view(qcur), (r + rot, T, H), contiguous=False)
        kq = g.op_("SOFT_MAX", (n_kv, T, H), F32, g.op_("MUL_MAT", (n_kv, T, H), F32, kp, qp), mask)
        a = g.op_("MUL_MAT", (r, T, H), F32, v, kq)
        a = g.op_("MUL_MAT", (m.head_dim_v, T, H), F32, w(), a)
        a = g.op_("CONT", (m.head_dim_v * H, T), F32, g.view(a, (m.head_dim_v, H, T), contiguous=False))
    return g.op_("MUL_MAT", (spec.n_embd, T), F32, w(), a)


def _hadamard(g: _Graph, t: int, rot: int, shape: tuple) -> int:
    """llama_mul_mat_hadamard: the rows cut into blocks of the rotation's size, multiplied, reshaped back."""
    r = g.layout[rot][0]
    n = 1
    for d in shape:
        n *= d
    return g.view(g.op_("MUL_MAT", (r, n // r), F32, rot, g.view(t, (r, n // r))), shape)


def _legacy_attention(g, spec, x, pos, kv_inputs, temperature, n_kv, T, flash_attn, k_rot, v_rot, n_stream,
                      type_k, type_v) -> int:
    m, w = spec.mla, g.weight
    r, rot = m.kv_lora_rank, m.n_rot
    hk, hv = m.head_dim_k, m.head_dim_v
    nope = hk - rot
    q, H = _query(g, spec, x, T)
    qcur = temperature(g.op_("ROPE", (hk, H, T), F32, q, pos), (hk, H, T))
    if k_rot is not None:
        qcur = _hadamard(g, qcur, k_rot, (hk, H, T))
    pe, kv = _compress(g, spec, x, T)
    kvb = g.op_("MUL_MAT", (H * (nope + hv), T), F32, w(), kv)
    vcur = g.op_("CONT", (hv, H, T), F32, g.view(kvb, (hv, H, T), voff=nope * F32, contiguous=False))
    if v_rot is not None:
        vcur = _hadamard(g, vcur, v_rot, (hv, H, T))
    k_nope = g.view(kvb, (nope, H, T), contiguous=False)
    k_pe = g.op_("ROPE", (rot, 1, T), F32, g.view(pe, (rot, 1, T), voff=r * F32, contiguous=False), pos)
    kcur = g.op_("CONCAT", (hk, H, T), F32, k_nope, g.op_("REPEAT", (rot, H, T), F32, k_pe))
    if k_rot is not None:
        kcur = _hadamard(g, kcur, k_rot, (hk, H, T))
    k_idx, v_idx, mask = kv_inputs()
    kc, vc = g.weight("kv"), g.weight("kv")
    _set_rows(g, g.view(kcur, (hk * H, T)), k_idx, kc)
    if flash_attn:
        _set_rows(g, g.view(vcur, (hv * H, T)), v_idx, vc)
    else:
        _set_rows(g, g.view(g.view(vcur, (hv * H, T)), (1, hv * H * T)), v_idx, g.view(vc, (1,), contiguous=False))
    qp = g.view(g.view(qcur), (hk, T, H), contiguous=False)
    kp = g.view(g.view(kc, (hk, H, n_kv), contiguous=False), (hk, n_kv, H), contiguous=False)
    vp = g.view(g.view(vc, (hv, H, n_kv), contiguous=False), (hv, n_kv, H), contiguous=False)
    if flash_attn:
        if type_k == "f32":
            kp = g.op_("CPY", (hk, n_kv, H, n_stream), F16, kp)
        if type_v == "f32":
            vp = g.op_("CPY", (hv, n_kv, H, n_stream), F16, vp)
        a = g.view(g.op_("FLASH_ATTN_EXT", (hv, H, T), F32, qp, kp, vp, mask), (hv * H, T))
    else:
        kq = g.op_("SOFT_MAX", (n_kv, T, H), F32, g.op_("MUL_MAT", (n_kv, T, H), F32, kp, qp), mask)
        kqv = g.op_("MUL_MAT", (hv, T, H), F32, vp, kq)
        a = g.op_("CONT", (hv * H, T), F32, g.view(kqv, (hv, H, T), contiguous=False))
    if v_rot is not None:
        a = _hadamard(g, a, v_rot, (hv * H, T))
    return g.op_("MUL_MAT", (spec.n_embd, T), F32, w(), a)
