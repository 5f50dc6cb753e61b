"""One decoder-only transformer for llama, qwen2 and qwen3 GGUF files.

    x = embed(tokens)
    per layer:  h = rmsnorm(x)
                q, k, v = h·Wq (+bq), h·Wk (+bk), h·Wv (+bv)       biases: qwen2
                q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)    qwen3
                q, k = rope(q), rope(k)                            norm (llama) / neox (qwen)
                cache ← k, v;  x += softmax(q·Kᵀ/√d + mask)·V · Wo  (GQA through SDPA)
                x += (silu(rmsnorm(x)·Wgate) ⊙ rmsnorm(x)·Wup) · Wdown
    logits = rmsnorm(x)·Wout   (Wout = embedding when tied), only at the rows asked for

``prefill`` runs a chunk of one sequence; ``decode`` runs one token for each of
b sequences with shapes that do not depend on the data (attention spans the
whole cache under a mask), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp.memory import DEFAULT_OUTPUTS_MAX
from localinfer.model.spec import ModelSpec

from . import ggml_numerics, quant, rope
from .kv_cache import KVCache
from .weights import Packed, Weight

# The llama.cpp backend's defaults for the logit rows per llama_decode and the tokens per
# graph (n_outputs_max, LoadPlan.n_ubatch): the emulation cuts a prefill as it does.
_LLAMACPP_OUTPUTS_MAX = DEFAULT_OUTPUTS_MAX
_LLAMACPP_UBATCH = LoadPlan.__dataclass_fields__["n_ubatch"].default

# llama.cpp converts queries to the K cache's dot-product type before Q·Kᵀ.
_QUERY_ROUNDING = {"f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int
    rms_eps: float
    rope: rope.RopeConfig
    qk_norm: bool

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelConfig:
        """Dimensions, norm epsilon and RoPE details from the spec (which reads the header's keys once)."""
        cfg = rope.RopeConfig(
            n_rot=spec.n_rot,
            base=spec.rope_base,
            pairing=rope.ROPE_PAIRING[spec.arch],
            freq_scale=spec.rope_freq_scale,
            yarn_orig_ctx=spec.yarn_orig_ctx if spec.rope_scaling == "yarn" else 0,
        )
        return cls(arch=spec.arch, n_layers=spec.n_layers, n_embd=spec.n_embd, n_head=spec.n_head[0],
                   n_head_kv=spec.n_head_kv[0], head_dim=spec.head_dim_k, n_ff=spec.n_ff[0],
                   vocab_size=spec.vocab_size, rms_eps=spec.rms_eps, rope=cfg, qk_norm=spec.qk_norm)


@dataclass
class Linear:
    """y = x·Wᵀ (+ b).  ``act`` rounds x the way llama.cpp's CPU kernels do for
    this weight's GGML type (see quant.ACTIVATION_ROUNDING); None leaves x exact."""

    w: Weight
    b: torch.Tensor | None = None
    act: str | None = None
    mins: torch.Tensor | None = None    # q4_1/q5_1 block mins [out, in/32], for q8_1 rounding

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.w, ggml_numerics.BlockMatrix):
            y = ggml_numerics.linear(x, self.w)
            return y if self.b is None else y + self.b
        w = self.w.dequantize(x.dtype) if isinstance(self.w, Packed) else self.w
        if self.act == "q8_1" and self.mins is not None:
            x, delta = quant.round_activations_q8_1(x)
            return F.linear(x, w, self.b) + F.linear(delta, self.mins)
        return F.linear(quant.round_activations(x, self.act), w, self.b)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w).to(x.dtype)


def _rmsnorm_ggml(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml's RMS norm to the bit: squares summed in double, mean in float, the scale
    1.0f/sqrtf(mean + eps).  torch.sqrt on the CPU is not correctly rounded (one value
    in six is an ulp off); torch.rsqrt gives 1.0f/sqrtf exactly.  Activations are then
    rounded to 8 bits, where one ulp can flip a tie."""
    xf = x.float()
    mean = (xf * xf).double().sum(-1, keepdim=True).div(x.shape[-1]).float()
    scale = torch.rsqrt(mean + torch.tensor(eps, dtype=torch.float32))
    return (xf * scale * w).to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
            scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v with grouped KV heads: q [b, H, t, d], k, v [b, H_kv, L, d];
    query head h reads KV head h // (H / H_kv), as llama.cpp broadcasts them."""
    b, n_head, t, d = q.shape
    n_kv, n_key = k.shape[1], k.shape[2]
    g = n_head // n_kv
    s = torch.matmul(q.reshape(b, n_kv, g * t, d), k.transpose(-1, -2)).mul_(scale).view(b, n_kv, g, t, n_key)
    if causal:
        mask = torch.ones(t, n_key, dtype=torch.bool, device=q.device).tril_(n_key - t)
    if mask is not None:
        s = s.masked_fill(~mask.reshape(-1, 1, 1, t, n_key), float("-inf"))
    p = torch.softmax(s, dim=-1).view(b, n_kv, g * t, n_key)
    return torch.matmul(p, v).view(b, n_head, t, d)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    ffn_norm: torch.Tensor
    w_gate: Linear
    w_up: Linear
    w_down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class Transformer:
    """The model's forward pass over a KVCache; weights by GGUF tensor name."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], n_pos: int, dtype: torch.dtype,
                 llamacpp_rounding: dict[str, str] | None = None):
        """``llamacpp_rounding`` maps tensor names to their GGML type names; given,
        activations and queries are rounded as llama.cpp's CPU kernels round them,
        which makes greedy decoding follow llama.cpp through near-ties."""
        self.cfg = cfg
        self.dtype = dtype
        self.emulate = llamacpp_rounding is not None
        self.norm = _rmsnorm_ggml if self.emulate else _rmsnorm
        self.glu = ggml_numerics.swiglu if self.emulate else _swiglu
        types = llamacpp_rounding or {}
        self.embd = weights["token_embd.weight"]
        out_name = "output.weight" if "output.weight" in weights else "token_embd.weight"
        self.output_norm = weights["output_norm.weight"]
        device = self.output_norm.device

        def lin(name: str) -> Linear:
            b = weights.get(name.replace(".weight", ".bias"))
            act = quant.ACTIVATION_ROUNDING.get(types[name]) if name in types else None
            return Linear(weights[name], None if b is None else b.to(dtype), act, weights.get(name + ":mins"))

        self.output = lin(out_name)
        self.layers = []
        for il in range(cfg.n_layers):
            p = f"blk.{il}."
            self.layers.append(Layer(
                attn_norm=weights[p + "attn_norm.weight"], wq=lin(p + "attn_q.weight"), wk=lin(p + "attn_k.weight"),
                wv=lin(p + "attn_v.weight"), wo=lin(p + "attn_output.weight"), ffn_norm=weights[p + "ffn_norm.weight"],
                w_gate=lin(p + "ffn_gate.weight"), w_up=lin(p + "ffn_up.weight"), w_down=lin(p + "ffn_down.weight"),
                q_norm=weights.get(p + "attn_q_norm.weight"), k_norm=weights.get(p + "attn_k_norm.weight")))
        freq_factors = weights.get("rope_freqs.weight")
        if self.emulate and not cfg.rope.yarn_orig_ctx:
            cos, sin = ggml_numerics.rope_tables(cfg.rope.n_rot, cfg.rope.base, cfg.rope.freq_scale, n_pos,
                                                 None if freq_factors is None else freq_factors.float().cpu())
            self.cos, self.sin = cos.to(device), sin.to(device)
            self.rope = ggml_numerics.rope_apply
        else:
            self.cos, self.sin = rope.tables(cfg.rope, n_pos, freq_factors, device)
            self.rope = rope.apply
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if self.emulate:    # llama.cpp's 1.0f/sqrtf(n_embd_head), in float32 (an ulp below for head size 96)
            self.scale = float(np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim)))
        # llama.cpp's context cells and threads, for the emulated decode kernel choice (see flash_attention)
        self.ggml_ctx_cells, self.ggml_threads = 0, 1
        # how the llama.cpp backend cuts an eval chunk into graphs (see _ggml_pieces): at most
        # ggml_outputs_max logit rows per llama_decode, at most ggml_ubatch tokens per graph
        self.ggml_outputs_max, self.ggml_ubatch = _LLAMACPP_OUTPUTS_MAX, _LLAMACPP_UBATCH
        # torch's CPU SDPA costs milliseconds per call at decode sizes; plain matmuls do not.
        self.manual_attention = device.type == "cpu"

    @property
    def device(self) -> torch.device:
        return self.output_norm.device

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embd, ggml_numerics.BlockMatrix):
            return self.embd.rows(tokens).to(self.dtype)
        if isinstance(self.embd, Packed):
            return Packed(self.embd.blocks[tokens], self.embd.kind).dequantize(self.dtype)
        return F.embedding(tokens, self.embd).to(self.dtype)

    def _attention(self, il: int, L: Layer, h: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: KVCache, rows: torch.Tensor, seqs: torch.Tensor | None,
                   n_attn: int, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        c = self.cfg
        b, t, _ = h.shape
        q = L.wq(h).view(b, t, c.n_head, c.head_dim)
        k = L.wk(h).view(b, t, c.n_head_kv, c.head_dim)
        v = L.wv(h).view(b, t, c.n_head_kv, c.head_dim)
        if L.q_norm is not None:
            q = self.norm(q, L.q_norm, c.rms_eps)
            k = self.norm(k, L.k_norm, c.rms_eps)
        q = self.rope(q, cos, sin, c.rope.pairing)
        k = self.rope(k, cos, sin, c.rope.pairing)
        cache.write(il, rows, pos, k, v)
        keys, values = cache.read(il, seqs, b, n_attn)
        if self.emulate and cache.type_k == cache.type_v == "f16":
            if causal:
                mask = torch.ones(t, n_attn, dtype=torch.bool, device=h.device).tril_(n_attn - t)
            o = ggml_numerics.flash_attention(q.transpose(1, 2), keys, values, mask, self.scale,
                                              n_view=self._ggml_view(pos), n_threads=self.ggml_threads)
            return L.wo(o.transpose(1, 2).reshape(b, t, c.n_head * c.head_dim))
        if self.emulate:
            q = quant.round_activations(q, _QUERY_ROUNDING.get(cache.type_k))
        if self.manual_attention:
            o = _attend(q.transpose(1, 2), keys, values, mask, causal, self.scale)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal,
                                               scale=self.scale, enable_gqa=c.n_head != c.n_head_kv)
        return L.wo(o.transpose(1, 2).reshape(b, t, c.n_head * c.head_dim))

    def _ggml_view(self, pos: torch.Tensor) -> int:
        """Cells llama.cpp's graph attends for a one-token step at pos [1, 1]: the used cells
        padded to 256, at least 256, at most the context (0 when not a one-token step)."""
        if pos.numel() != 1 or not self.ggml_ctx_cells:
            return 0
        pad = ggml_numerics.KV_VIEW_PAD
        used = -(-(int(pos.reshape(-1)[0]) + 1) // pad) * pad
        return min(self.ggml_ctx_cells, max(pad, used))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, *, seqs: torch.Tensor | None,
                n_attn: int, mask: torch.Tensor | None, causal: bool = False,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) of tokens [b, t] at positions pos [b, t] of sequences seqs [b]
        (None: 0..b-1), attending to the first n_attn cache positions under mask
        [b, 1, t, n_attn] (or is_causal, or nothing); only rows out_rows of the
        flattened [b·t] tokens get logits (None: all)."""
        c = self.cfg
        b, t = tokens.shape
        rows = (torch.arange(b, device=tokens.device) if seqs is None else seqs)[:, None]
        cos, sin = self.cos[pos], self.sin[pos]
        x = self._embed(tokens)
        for il, L in enumerate(self.layers):
            h = self.norm(x, L.attn_norm, c.rms_eps)
            x = x + self._attention(il, L, h, pos, cos, sin, cache, rows, seqs, n_attn, mask, causal)
            h = self.norm(x, L.ffn_norm, c.rms_eps)
            x = x + L.w_down(self.glu(L.w_gate(h), L.w_up(h)))
        x = x.reshape(b * t, c.n_embd)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
        return self.output(self.norm(x, self.output_norm, c.rms_eps)).float()

    def prefill(self, tokens: torch.Tensor, start: int, cache: KVCache, seq: int,
                out_rows: torch.Tensor | None) -> torch.Tensor:
        """Append tokens [t] to sequence seq at positions start..; logits at out_rows.

        Emulating llama.cpp, the chunk runs as the llama.cpp backend runs it: one forward
        per graph llama.cpp computes (see :meth:`_ggml_pieces`), since the kernels (the
        flash-attention one above all) depend on how many rows a graph has."""
        t = tokens.shape[0]
        if not self.emulate or t == 1:
            return self._prefill(tokens, start, cache, seq, out_rows)
        rows = list(range(t)) if out_rows is None else [int(i) for i in out_rows.tolist()]
        pieces = self._ggml_pieces(t, rows)
        if len(pieces) == 1:
            return self._prefill(tokens, start, cache, seq, out_rows)
        got: dict[int, torch.Tensor] = {}
        for lo, hi, mine in pieces:
            sel = torch.tensor([i - lo for i in mine], dtype=torch.long, device=tokens.device)
            logits = self._prefill(tokens[lo:hi], start + lo, cache, seq, sel)
            got.update(zip(mine, logits))
        if not rows:
            return torch.zeros(0, self.cfg.vocab_size, device=tokens.device)
        return torch.stack([got[i] for i in rows])

    def _ggml_pieces(self, t: int, rows: list[int]) -> list[tuple[int, int, list[int]]]:
        """The graphs llama.cpp computes for one eval chunk of t tokens with logits at rows:
        (lo, hi, output rows) per graph.  The llama.cpp backend's _eval_chunk ends a
        llama_decode after ggml_outputs_max output rows (the last of them included), and
        llama_decode cuts its batch into ubatches of ggml_ubatch tokens."""
        want = sorted(set(rows))
        cap, ub = max(1, self.ggml_outputs_max), max(1, self.ggml_ubatch)
        pieces, lo = [], 0
        while lo < t:
            ahead = [i for i in want if i >= lo]
            hi = t if len(ahead) < cap else ahead[cap - 1] + 1
            for u in range(lo, hi, ub):
                v = min(u + ub, hi)
                pieces.append((u, v, [i for i in want if u <= i < v]))
            lo = hi
        return pieces

    def _prefill(self, tokens: torch.Tensor, start: int, cache: KVCache, seq: int,
                 out_rows: torch.Tensor | None) -> torch.Tensor:
        t = tokens.shape[0]
        dev = self.device
        pos = torch.arange(start, start + t, device=dev)[None]
        seqs = None if seq == 0 else torch.tensor([seq], device=dev)
        n_attn = start + t
        if start == 0 or t == 1:
            mask, causal = None, t > 1
        else:
            mask = (torch.arange(n_attn, device=dev)[None, :] <= pos[0][:, None])[None, None]
            causal = False
        return self.forward(tokens[None], pos, cache, seqs=seqs, n_attn=n_attn, mask=mask, causal=causal,
                            out_rows=out_rows)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache,
               seqs: torch.Tensor | None = None, n_attn: int | None = None) -> torch.Tensor:
        """One token for each of b sequences: tokens, pos [b]; logits [b, vocab].

        With n_attn None attention spans the whole cache under a mask built on
        the device, so nothing depends on host values (CUDA-graph safe).
        """
        n_attn = cache.capacity if n_attn is None else n_attn
        key = torch.arange(n_attn, device=tokens.device)
        mask = (key[None, :] <= pos[:, None])[:, None, None, :]
        return self.forward(tokens[:, None], pos[:, None], cache, seqs=seqs, n_attn=n_attn, mask=mask)
