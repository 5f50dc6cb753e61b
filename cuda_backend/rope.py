"""Rotary position embeddings the way llama.cpp applies them.

Two pairings (llama.cpp's ``llama_model_rope_type``):

* ``norm`` (llama): rotate consecutive values (x[2i], x[2i+1]).  GGUF's llama
  Q/K rows were permuted by the converter so that this pairing reproduces the
  original model; the weights are used as stored.
* ``neox`` (qwen2, qwen3): rotate x[i] with x[i + n_rot/2].

Angle of pair i at position p: p · s · base^(−2i/n_rot) / f_i, with s the
linear frequency scale (1/factor), f_i the optional ``rope_freqs`` factors
(Llama 3's long-context scaling) and, for YaRN, a ramp that blends the scaled
and unscaled angle per dimension plus a magnitude correction (ggml's rope_yarn).
Only the first n_rot values of a head rotate; the rest pass through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_PAIRING = {"llama": "norm", "qwen2": "neox", "qwen3": "neox"}


@dataclass(frozen=True)
class RopeConfig:
    n_rot: int
    base: float = 10000.0
    pairing: str = "neox"
    freq_scale: float = 1.0
    yarn_orig_ctx: int = 0          # > 0 switches YaRN on
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    attn_factor: float = 1.0


def _yarn_corr_dim(n_rot: int, n_ctx_orig: int, beta: float, base: float) -> float:
    return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))


def tables(cfg: RopeConfig, n_pos: int, freq_factors: torch.Tensor | None = None,
           device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, float32 [n_pos, n_rot/2]."""
    half = cfg.n_rot // 2
    i = torch.arange(half, dtype=torch.float64)
    theta_extrap = cfg.base ** (-2.0 * i / cfg.n_rot)
    if freq_factors is not None:
        theta_extrap = theta_extrap / freq_factors.double().cpu()
    theta_interp = cfg.freq_scale * theta_extrap
    mscale = cfg.attn_factor
    if cfg.yarn_orig_ctx:
        low = max(0.0, math.floor(_yarn_corr_dim(cfg.n_rot, cfg.yarn_orig_ctx, cfg.yarn_beta_fast, cfg.base)))
        high = min(cfg.n_rot - 1.0, math.ceil(_yarn_corr_dim(cfg.n_rot, cfg.yarn_orig_ctx, cfg.yarn_beta_slow, cfg.base)))
        ramp = 1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)
        freqs = theta_interp * (1 - ramp) + theta_extrap * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / cfg.freq_scale)
    else:
        freqs = theta_interp
    angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * freqs[None, :]
    cos = (torch.cos(angles) * mscale).float().to(device)
    sin = (torch.sin(angles) * mscale).float().to(device)
    return cos, sin


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """Rotate x [b, t, heads, head_dim] by cos/sin [b, t, n_rot/2] (computed in float32)."""
    n_rot = cos.shape[-1] * 2
    rot, rest = (x, None) if n_rot == x.shape[-1] else (x[..., :n_rot], x[..., n_rot:])
    c = cos[:, :, None, :]
    s = sin[:, :, None, :]
    r = rot.float()
    if pairing == "norm":
        a, b = r[..., 0::2], r[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = r[..., : n_rot // 2], r[..., n_rot // 2:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    out = out.to(x.dtype)
    return out if rest is None else torch.cat((out, rest), dim=-1)
