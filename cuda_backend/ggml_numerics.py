"""llama.cpp's CPU kernels, rounding for rounding (x86, AVX2 + FMA builds).

Greedy decoding follows the larger of two near-tied logits, and a quantized
model amplifies every last-bit difference: activations are rounded to 8 bits
before each matmul, so one ulp on the wrong side of a rounding tie moves a
value by a whole step and the models drift apart.  To follow llama.cpp token
for token, the torch backend's ``llamacpp_rounding`` mode reproduces how
ggml's CPU kernels round, not just what they compute.  Each piece was checked
against tensors captured from llama.cpp's graph (tests/support/ggml_capture.py):

* matmuls with q4_0/q4_1/q8_0 weights (:func:`linear`): activations quantized
  to q8_0/q8_1 blocks, integer lane sums, one FMA per block, ``hsum_float_8``;
  Q4_0 matrices with a multiple of 8 rows as llama.cpp repacks them (q4_0x8:
  whole-block integer dots, one FMA per block, no lane sum);
* SwiGLU (:func:`swiglu`) with ``ggml_v_expf``, ggml's vectorised exp;
* RoPE (:func:`rope_tables`, :func:`rope_apply`): θ multiplied up in float32,
  libm's cosf/sinf, the rotation contracted to FMAs;
* flash attention on an F16 K/V cache (:func:`flash_attention`): for fewer than
  64 query rows one row at a time with an **f16** running output (every rescale
  and every ``v·w`` FMA rounds to f16); for 64 or more the tiled float32 kernel
  (FMA chains in ``simd_gemm`` order, weights summed 8 lanes at a time); for one
  token over a KV view of 512+ cells, the split kernel: one chunk per thread,
  partial results merged in thread order.

The kernel llama.cpp picks depends on the graph's shape, so the model runs a
prefill in the graphs the llama.cpp backend computes (cuda_backend/model.py,
``Transformer._ggml_pieces``: a llama_decode ends after 64 logit rows, a batch
runs in ubatches), and scales scores by llama.cpp's float32 ``1.0f/sqrtf(d)``.
Checked on every row of 300- to 1100-token prompts on generated llama, qwen2 and
qwen3 files (head sizes 16 to 256, grouped and plain KV heads, Q/K norms, biases,
rope_freqs, tied and untied outputs, 1 to 3 threads) and on the embedded model
(tests/cuda_backend/test_torch_llamacpp_exact*.py, benchmarks/llamacpp_exact.py).

float64 stands in for FMA: the products here (f16·f32, f32·f32, f16·f16·int)
are exact in float64, so one rounding to float32 afterwards is the FMA's
single rounding.  Two torch traps matter at this precision: ``torch.sqrt`` on
the CPU is not correctly rounded (``torch.rsqrt`` matches ``1.0f/sqrtf``), and
``scalar / tensor`` is a reciprocal times the scalar (``full_like(t, c) / t`` is
a true division).  Not reproduced: matmuls with K-quant and F16 weights (their
activations are rounded, the dot order is not), attention without flash attention
or on a quantized KV cache, YaRN RoPE, several sequences decoded in one llama.cpp
batch, and other CPUs' kernels (AVX-512
and ARM NEON sum in other orders; :func:`kernel_mismatch` says when the installed
build is one of them).
"""

from __future__ import annotations

import numpy as np
import torch

from . import ggml_matmul as _mm

# the matmul half of the kernels, re-exported
_CHUNK_TERMS, _hsum8 = _mm._CHUNK_TERMS, _mm._hsum8
EMULATED_TYPES, BlockMatrix, linear, quantize_q8 = _mm.EMULATED_TYPES, _mm.BlockMatrix, _mm.linear, _mm.quantize_q8
repacked_by_llamacpp = _mm.repacked_by_llamacpp


def kernel_mismatch() -> str | None:
    """Why the installed llama.cpp's CPU kernels are not the ones this module reproduces
    (x86-64 with AVX2 and FMA, without AVX-512, whose wider vectors change the sum
    orders), or None when they are."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"llama.cpp's kernels on {platform.machine()} sum in other orders than its x86 AVX2 ones"
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
    except Exception as e:                          # noqa: BLE001 - any failure means "cannot tell"
        return f"cannot read llama.cpp's CPU features ({e})"
    flags = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in info.split("|")) if v}
    if flags.get("AVX2") != "1" or flags.get("FMA") != "1":
        return "this llama.cpp build has no AVX2/FMA kernels"
    if flags.get("AVX512") == "1":
        return "this llama.cpp build uses AVX-512 kernels (16-wide sums)"
    return None


_STEP, _LANES = 32, 8       # GGML_F16_STEP and GGML_F16_EPR for AVX/AVX2
_TILE = 64                  # GGML_FA_TILE_Q and GGML_FA_TILE_KV




def dot_f16(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """ggml_vec_dot_f16 of f16-valued q [..., t, d] with k [..., L, d]: scores [..., t, L]
    with ggml's AVX summation order (float32 throughout)."""
    t, d = q.shape[-2], q.shape[-1]
    step = max(1, _CHUNK_TERMS // max(1, k[..., 0].numel() * d))
    if t > step:
        return torch.cat([dot_f16(q[..., i:i + step, :], k) for i in range(0, t, step)], dim=-2)
    p = q.float().unsqueeze(-2) * k.float().unsqueeze(-3)          # [..., t, L, d], exact
    n = d - d % _STEP
    acc = None
    for i in range(0, n, _STEP):
        chunk = p[..., i:i + _STEP].unflatten(-1, (4, _LANES))     # sum[j] lanes
        acc = chunk if acc is None else acc + chunk
    if acc is None:
        total = torch.zeros(p.shape[:-1], dtype=torch.float64, device=p.device)
    else:
        x = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
        t0 = x[..., :4] + x[..., 4:]
        total = ((t0[..., 0] + t0[..., 1]) + (t0[..., 2] + t0[..., 3])).double()
    for i in range(n, d):                                            # leftovers, in double
        total = total + p[..., i].double()
    return total.float()


def _rows_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-row kernel's state after its keys: unnormalised output (f16 values),
    weight sum S and running maximum M, float32 [b, H, t, d], [b, H, t], [b, H, t]."""
    b, n_head, t, d = q.shape
    n_kv, n_key = k.shape[1], k.shape[2]
    g = n_head // n_kv
    q16 = q.half().float().reshape(b, n_kv, g * t, d)
    s = dot_f16(q16, k).mul_(scale).view(b, n_kv, g, t, n_key)          # float32, as ggml
    if mask is not None:
        s = s.masked_fill(~mask.reshape(-1, 1, 1, t, n_key), float("-inf"))
    s = s.reshape(b, n_head, t, n_key)
    valid = torch.isfinite(s)
    # running maximum and the two factors of each step, as the sequential loop sees them
    m = torch.cummax(s, dim=-1).values
    m_old = torch.cat([torch.full_like(m[..., :1], float("-inf")), m[..., :-1]], dim=-1)
    new_max = valid & (s > m_old)
    ms = torch.where(new_max, _libm_expf(m_old - m), torch.ones_like(s))
    vs = torch.where(new_max, torch.ones_like(s), _libm_expf(s - m))
    vs = torch.where(valid, vs, torch.zeros_like(s))
    ms = torch.where(valid, ms, torch.ones_like(s))
    v64 = v.double().repeat_interleave(g, dim=1)                           # [b, H, L, d]
    acc = torch.zeros(b, n_head, t, d, dtype=torch.float64, device=q.device)
    total = torch.zeros(b, n_head, t, dtype=torch.float64, device=q.device)
    ms64, vs64 = ms.double(), vs.double()
    for j in range(n_key):
        mj = ms64[..., j]
        acc = (acc * mj.unsqueeze(-1)).float().half().double()
        acc = (acc + v64[:, :, j].unsqueeze(2) * vs64[..., j].unsqueeze(-1)).float().half().double()
        total = (total * mj + vs64[..., j]).float().double()
    top = m[..., -1] if n_key else torch.full((b, n_head, t), float("-inf"), device=q.device)
    return acc.float(), total.float(), top


def _normalise(acc: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """out = acc · (1.0f / S), zero where S is 0."""
    inv = torch.where(total != 0, torch.reciprocal(total), torch.zeros_like(total))
    return acc * inv.unsqueeze(-1)


def _flash_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk: f16 query, f16 running output."""
    acc, total, _ = _rows_state(q, k, v, mask, scale)
    return _normalise(acc, total)


def _flash_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float, n_view: int, n_threads: int) -> torch.Tensor:
    """The split-KV decode kernel (one query row, a KV view of 512+ cells): thread i runs
    the one-row kernel over cells [i·c, (i+1)·c), c = ceil(n_view / n_threads), and the
    partial results are merged in thread order (ggml_flash_attn_ext_reduce_partials)."""
    chunk = -(-n_view // n_threads)
    n_key = k.shape[2]
    m_f = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    s_f = torch.zeros_like(m_f)
    acc_f = torch.zeros_like(q, dtype=torch.float32)
    for lo in range(0, min(n_view, n_key), chunk):
        hi = min(lo + chunk, n_key)
        part = None if mask is None else mask[..., lo:hi]
        acc_c, s_c, m_c = _rows_state(q, k[:, :, lo:hi], v[:, :, lo:hi], part, scale)
        live = s_c != 0
        m_new = torch.maximum(m_f, m_c)
        old, new = _libm_expf(m_f - m_new), _libm_expf(m_c - m_new)
        acc_n = _fma(acc_f, old.unsqueeze(-1), acc_c * new.unsqueeze(-1))
        s_n = _fma(s_f, old, s_c * new)
        acc_f = torch.where(live.unsqueeze(-1), acc_n, acc_f)
        s_f = torch.where(live, s_n, s_f)
        m_f = torch.where(live, m_new, m_f)
    return _normalise(acc_f, s_f)


def _libm_expf(x: torch.Tensor) -> torch.Tensor:
    """expf as glibc rounds it: exp in float64, rounded once to float32."""
    return torch.exp(x.double()).float()


def _flash_attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """ggml_compute_forward_flash_attn_ext_tiled (64 or more query rows): float32 query,
    keys in tiles of 64; per tile the scores are FMA chains over the head dimension
    (simd_gemm), the weights ggml_v_expf(s - M) summed 8 lanes at a time into a double,
    and the output an FMA chain over the tile's keys, all in float32."""
    b, n_head, t, d = q.shape
    n_kv, n_key = k.shape[1], k.shape[2]
    g = n_head // n_kv
    kf = k.float().repeat_interleave(g, dim=1)                                 # [b, H, L, d]
    vf = v.float().repeat_interleave(g, dim=1)
    allowed = (torch.ones(b, 1, t, n_key, dtype=torch.bool, device=q.device) if mask is None
               else mask.reshape(-1, 1, t, n_key).expand(b, 1, t, n_key))
    m_run = torch.full((b, n_head, t), float("-inf"), device=q.device)
    s_run = torch.zeros(b, n_head, t, device=q.device)
    acc = torch.zeros(b, n_head, t, d, device=q.device)
    qf = q.float()
    for ic in range(0, n_key, _TILE):
        tile = slice(ic, min(ic + _TILE, n_key))
        ok = allowed[..., tile]
        if not bool(ok.any()):
            continue
        kt, vt = kf[:, :, tile], vf[:, :, tile]
        kq = torch.zeros(b, n_head, t, kt.shape[2], device=q.device)
        for kk in range(d):
            kq = _fma(qf[..., kk, None], kt[:, :, None, :, kk], kq)
        kq = kq * scale
        kq = kq.masked_fill(~ok, float("-inf"))
        tile_max = kq.amax(-1)
        live = tile_max != float("-inf")
        m_new = torch.maximum(m_run, tile_max)
        grow = live & (m_new > m_run)
        ms = torch.where(grow, _libm_expf(m_run - m_new), torch.ones_like(m_new))
        acc = acc * ms.unsqueeze(-1)
        s_run = s_run * ms
        m_run = torch.where(live, m_new, m_run)
        p = expf_v(kq - m_run.unsqueeze(-1))
        p = torch.where(live.unsqueeze(-1), p, torch.zeros_like(p))
        pad = (-p.shape[-1]) % 8
        lanes = torch.nn.functional.pad(p, (0, pad)).unflatten(-1, (-1, 8))
        lane_sums = _hsum8(lanes).double()
        total = s_run.double()
        partial = torch.zeros_like(total)
        for j in range(lane_sums.shape[-1]):
            partial = partial + lane_sums[..., j]
        s_run = torch.where(live, (total + partial).float(), s_run)
        for j in range(p.shape[-1]):
            acc = _fma(p[..., j, None], vt[:, :, None, j, :], acc)
    inv = torch.where(s_run != 0, torch.reciprocal(s_run), torch.zeros_like(s_run))
    return acc * inv.unsqueeze(-1)


SPLIT_KV_CELLS = 512        # ggml splits one-row decode attention over threads from this KV view size
KV_VIEW_PAD = 256           # llama.cpp pads its context and the attended KV view to 256 cells


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, *, n_view: int = 0, n_threads: int = 1) -> torch.Tensor:
    """Attention output [b, H, t, d] as ggml's CPU flash attention computes it for an F16
    K/V cache: q [b, H, t, d]; k, v [b, H_kv, L, d] holding f16 values; mask broadcastable
    to [b, 1, t, L] (True = attend) or None.  Like ggml, 64 or more query rows take the
    tiled kernel; one query row over a KV view (``n_view``: the cells llama.cpp's graph
    attends, masked ones included) of 512 or more cells is split over ``n_threads``;
    otherwise the one-row kernel."""
    b, _, t, _ = q.shape
    if t >= _TILE:
        return _flash_attention_tiled(q, k, v, mask, scale)
    if b == 1 and t == 1 and n_view >= SPLIT_KV_CELLS and n_threads > 1:
        return _flash_attention_split(q, k, v, mask, scale, n_view, n_threads)
    return _flash_attention_rows(q, k, v, mask, scale)


# ---- matmuls with quantized weights ------------------------------------------------------------
#
# ggml quantizes each activation row to 8 bits per block of 32 (q8_1 for q4_1
# weights, q8_0 for q4_0/q8_0), then ggml_vec_dot_<w>_<x> (AVX2) multiplies
# integer codes block by block: 8 lanes, each the exact integer sum of 4
# neighbouring products, accumulated over the blocks with one FMA per block
# (scale d_w·d_x), reduced by hsum_float_8; q4_1 adds Σ m_w · s_x in a scalar.
# llamafile's tinyBLAS_Q0_AVX (q8_0 and q4_0 weights) sums in the same order.
#
# Q4_0 matrices with a multiple of 8 rows are different: llama.cpp (CPU_REPACK
# buffer, on by default) repacks them into block_q4_0x8 and multiplies them with
# ggml_gemm/gemv_q4_0_8x8_q8_0, where each output is one float32 lane: the whole
# block's integer dot product, then one FMA per block with the float32 product
# d_w·d_x, and no horizontal sum.  A tied output matrix is repacked too (llama.cpp
# loads token_embd a second time as the output, a MUL_MAT weight); the embedding
# lookup dequantizes, which is exact in either layout.

def _fma(a: torch.Tensor, b, c) -> torch.Tensor:
    a64 = a.double()
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    return (a64 * b64 + c64).float()


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


_R = _f32(float.fromhex("0x1.8p23"))
_LOG2E = _f32(float.fromhex("0x1.715476p+0"))
_LN2_HI, _LN2_LO = _f32(float.fromhex("0x1.62e4p-1")), _f32(float.fromhex("0x1.7f7d1cp-20"))
_P = [_f32(float.fromhex(h)) for h in ("0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5",
                                       "0x1.0e4020p-7")]


def expf_v(x: torch.Tensor) -> torch.Tensor:
    """ggml_v_expf on float32 x, element by element (its lanes do not interact)."""
    x = x.float()
    z = _fma(x, _LOG2E, _R)
    n = z - _R
    b = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, x))
    e = torch.bitwise_left_shift(z.view(torch.int32), 23)
    k = (e + 0x3F800000).view(torch.float32)
    u = b * b
    j = _fma(_fma(_fma(torch.full_like(b, _P[4]), b, _P[3]), u, _fma(torch.full_like(b, _P[2]), b, _P[1])), u,
             b * _P[0])
    out = _fma(j, k, k)
    big = n.abs() > 126
    if bool(big.any()):
        g = torch.where(n <= 0, torch.tensor(-0x7E000000, dtype=torch.int32), torch.tensor(0, dtype=torch.int32))
        s1 = (g + 0x7F000000).view(torch.float32)
        s2 = (e - g).view(torch.float32)
        huge = n.abs() > 192
        out = torch.where(big, torch.where(huge, s1 * s1, _fma(s2, j, s2) * s1), out)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up as ggml_vec_swiglu_f32 computes it (rows of the last dimension)."""
    gate, up = gate.float(), up.float()
    n = gate.shape[-1]
    head = n - n % 8
    x = gate[..., :head]
    y = x / (1.0 + expf_v(-x)) * up[..., :head]
    if head == n:
        return y
    tail = gate[..., head:]
    libm = tail / (1.0 + torch.exp(-tail.double()).float())
    return torch.cat([y, libm * up[..., head:]], dim=-1)


# ---- RoPE ----------------------------------------------------------------------------------------
#
# ggml_rope_cache_init: per position, θ starts at the position (float32) and is
# multiplied by powf(base, −2/n_rot) once per pair, in float32; the table holds
# libm's cosf/sinf of θ (÷ the pair's rope_freqs factor).  rotate_pairs then
# computes x0·cos − x1·sin and x0·sin + x1·cos, which the compiler contracts
# to fma(x0, cos, −(x1·sin)) and fma(x0, sin, x1·cos).

def _libm():
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for name, n_args in (("cosf", 1), ("sinf", 1), ("powf", 2)):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_float
        fn.argtypes = [ctypes.c_float] * n_args
    return lib


def rope_tables(n_rot: int, base: float, freq_scale: float, n_pos: int,
                freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n_pos, n_rot/2] as ggml_rope_cache_init fills them (no YaRN)."""

    lib = _libm()
    f32 = np.float32
    theta_scale = f32(lib.powf(f32(base), f32(-2.0) / f32(n_rot)))
    factors = [f32(1.0)] * (n_rot // 2) if freq_factors is None else [f32(v) for v in freq_factors.tolist()]
    cos = np.empty((n_pos, n_rot // 2), dtype=np.float32)
    sin = np.empty_like(cos)
    scale = f32(freq_scale)
    for p in range(n_pos):
        theta = f32(p)
        for i in range(n_rot // 2):
            angle = scale * (theta / factors[i])
            cos[p, i] = lib.cosf(angle)
            sin[p, i] = lib.sinf(angle)
            theta = theta * theta_scale
    return torch.from_numpy(cos), torch.from_numpy(sin)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """rotate_pairs on x [b, t, heads, head_dim] with cos/sin [b, t, n_rot/2], float32."""
    n_rot = cos.shape[-1] * 2
    r = x[..., :n_rot].float()
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if pairing == "norm":
        a, b = r[..., 0::2], r[..., 1::2]
    else:
        a, b = r[..., : n_rot // 2], r[..., n_rot // 2:]
    lo, hi = _fma(a, c, -(b * s)), _fma(a, s, b * c)
    out = torch.stack((lo, hi), dim=-1).flatten(-2) if pairing == "norm" else torch.cat((lo, hi), dim=-1)
    return out if n_rot == x.shape[-1] else torch.cat((out, x[..., n_rot:].float()), dim=-1)
