"""llama.cpp's speed, with its kernels' structure (docs/speed.md, "llama.cpp's kernels").

A decode step of ``b`` tokens at context ``L``::

    T = t_token + n_layer·t_layer + n_moe·t_moe + max(Σ_type D_type(b) / (β·e_type) + b·L·k / (β·e_kv),
                                         Σ_path F_path(b) / (P_path·m_path))

where ``D_type`` are the weight bytes of one type the step reads (routed experts as far as ``b``
tokens touch them), ``e_type`` the fraction of bandwidth llama.cpp's mat-vec kernel for that type
reaches (times ``e_moe`` for routed experts), and ``P_path`` the peak its mat-mat path runs at (INT8 tensor cores for quantized weights
on CUDA, FP16 for F16, ...).  A prefill is cut into micro-batches of ``u`` tokens; each costs::

    Σ_group max(2·N_active·u / (P_path·m_path), D_touched(u) / (β·e_type)) + n_layer·t_ubatch

Where the quantized path has no INT8 tensor cores and the kind dequantizes instead (``dequant_fallback``:
CUDA on Volta, and every CUDA build before MMQ ran on tensor cores), a quantized group's micro-batch is a
conversion to F16 (``D + 2·N`` bytes at the F16 mat-vec share of ``β``) followed by the F16 GEMM
(``max(2·N_active·u / (P_f16·m_f16), 2·N / β)``).

plus attention (``4·heads·head_dim`` FLOPs per query-key pair, at ``P_attn·m_attn``), the
activations' traffic (``act_passes · 4 · n_embd`` bytes per layer and token, at ``β``) and the last
token's logits.  A MoE micro-batch touches (nearly) every expert: their bytes are read once
per micro-batch and their FLOPs are the routed tokens' only.  The coefficients come from
:mod:`localinfer.devices.kernels` (per kind, fitted to published llama-bench results, overridable
per device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from localinfer.devices.kernels import KernelCoefficients, coefficients
from localinfer.model.cost import ModelCost, kv_pair, model_cost
from localinfer.util.memo import spec_cache

# where a device lacks the rate a path wants: INT8 mat-mats fall back to FP16 tensor math (llama.cpp dequantizes to
# FP16 for cuBLAS where there are no INT8 tensor cores, as on Volta), and BF16 to FP16 and back (a part without one
# format runs those kernels in the other)
_FALLBACK_PEAK = {"int8_ops": ("fp16_flops", "bf16_flops"), "fp16_flops": ("bf16_flops",),
                  "bf16_flops": ("fp16_flops",)}

# below this many tokens a micro-batch takes the quantized (dp4a) kernel even without INT8 tensor cores
# (llama.cpp ggml-cuda/mmq.cuh MMQ_DP4A_MAX_BATCH_SIZE)
DEQUANT_MIN_TOKENS = 64


@dataclass(frozen=True)
class WeightGroup:
    """The weights of one GGML type that one kind of tensor holds (dense, routed experts, or the head)."""

    type_name: str
    role: str             # "dense" | "expert" | "head"
    n_bytes: int
    n_elements: int       # every element stored (all experts)


def weight_groups(spec, exclude: frozenset[str] = frozenset()) -> tuple[WeightGroup, ...]:
    """The model's weights by (type, role): what decode and prefill read and multiply (memoised per spec),
    leaving out the tensors named in ``exclude`` (those held in host memory in a split)."""
    memo = spec_cache(spec).setdefault("weight_groups", {})
    if exclude in memo:
        return memo[exclude]
    acc: dict[tuple[str, str], list[int]] = {}
    head_name = "output.weight" if spec.tensor("output.weight") is not None else "token_embd.weight"
    for t in spec.tensors:
        if (t.name == "token_embd.weight" and head_name != t.name) or t.name in exclude:
            continue                        # looked up by row, never read whole; or not on this device
        role = "head" if t.name == head_name else ("expert" if "_exps." in t.name else "dense")
        key = (t.type.name.lower(), role)
        g = acc.setdefault(key, [0, 0])
        g[0] += t.n_bytes
        g[1] += t.n_elements if len(t.shape) >= 2 else 0
    out = tuple(WeightGroup(k[0], k[1], v[0], v[1]) for k, v in sorted(acc.items()))
    memo[exclude] = out
    return out


def moe_layers(spec) -> int:
    """Layers with routed experts (memoised per spec)."""
    memo = spec_cache(spec)
    if "moe_layers" not in memo:
        memo["moe_layers"] = len({t.name.split(".")[1] for t in spec.tensors
                                  if "_exps." in t.name and t.name.startswith("blk.")})
    return memo["moe_layers"]


def peak_field(device, coeff: KernelCoefficients, path: str) -> str | None:
    """The profile field ``path`` runs at on ``device``: the one its kind names, else the next one it has."""
    wanted = coeff.peaks.get(path, "bf16_flops")
    return next((name for name in (wanted,) + _FALLBACK_PEAK[wanted] if getattr(device, name, None)), None)


def peak(device, coeff: KernelCoefficients, path: str) -> float | None:
    """The rate ``path`` runs at on ``device`` (:func:`peak_field`)."""
    name = peak_field(device, coeff, path)
    return float(getattr(device, name)) if name else None


@dataclass(frozen=True)
class Timing:
    seconds: float
    compute_s: float
    memory_s: float
    fixed_s: float
    flops: int
    bytes: int


class KernelSpeed:
    """llama.cpp's decode and prefill times for one model on one device."""

    def __init__(self, spec, device, coeff: KernelCoefficients, ubatch: int = 512,
                 exclude: frozenset[str] = frozenset()):
        self.spec = spec
        self.device = device
        self.coeff = coeff
        self.ubatch = max(1, int(ubatch))
        self.cost: ModelCost = model_cost(spec)
        self.groups = weight_groups(spec, exclude)   # decode reads these on the device; prefill multiplies all
        self.all_groups = weight_groups(spec) if exclude else self.groups
        self.bandwidth = float(device.bandwidth_bytes_per_s)
        self.n_layers = spec.n_layers
        self.n_expert = spec.n_expert or 0
        self.n_used = spec.n_expert_used or 0
        self.moe_layers = moe_layers(spec)
        # no INT8 tensor-core path: quantized mat-mats dequantize to F16 and run the F16 GEMM (kernels.py)
        self.dequant = coeff.dequant_fallback and peak_field(device, coeff, "quant") != "int8_ops"

    def _touched(self, group: WeightGroup, tokens: int) -> float:
        """Bytes of ``group`` that ``tokens`` routed tokens read (uniform routing)."""
        if group.role != "expert" or not self.n_expert:
            return float(group.n_bytes)
        return group.n_bytes * (1 - (1 - self.n_used / self.n_expert) ** max(tokens, 1))

    def _active(self, group: WeightGroup) -> float:
        """Multiply-accumulates per token in ``group``."""
        if group.role == "expert" and self.n_expert:
            return group.n_elements * self.n_used / self.n_expert
        return float(group.n_elements)

    def _share(self, group: WeightGroup) -> float:
        """The fraction of the bandwidth reading ``group`` reaches."""
        e = self.coeff.bandwidth_fraction(group.type_name)
        return e * self.coeff.decode_bw.get("moe", 1.0) if group.role == "expert" else e

    def _rate(self, path: str, group: WeightGroup | None = None) -> float:
        p = peak(self.device, self.coeff, path)
        if not p:
            return math.nan
        rate = p * self.coeff.prefill.get(path, self.coeff.prefill.get("quant", 0.5))
        if group is not None and group.role == "expert":
            rate *= self.coeff.prefill.get("moe", 1.0)
        return rate

    def kv_share(self, kv) -> float:
        """The fraction of the bandwidth reading the KV cache (of type ``kv``) reaches."""
        return self.coeff.decode_bw.get("kv", self.coeff.bandwidth_fraction(kv_pair(kv)[0]))

    def _kv_seconds(self, batch: int, context: int, kv) -> tuple[float, int]:
        kv_bytes = batch * (self.cost.kv_read_bytes(context, kv) + 2 * self.cost.state_bytes)
        return kv_bytes / (self.bandwidth * self.kv_share(kv)), kv_bytes

    def decode(self, batch: int = 1, context: int = 1, kv="f16", rows: int = 1) -> Timing:
        """One decode step: ``batch`` sequences at ``context``, each verifying ``rows`` positions (drafts): the
        weights see ``batch·rows`` tokens, the KV is read once per sequence."""
        c = self.coeff
        memory_s = compute_s = 0.0
        nbytes = flops = 0
        tokens = batch * max(1, rows)
        for g in self.groups:
            read = self._touched(g, tokens)
            memory_s += read / (self.bandwidth * self._share(g))
            nbytes += round(read)
            f = 2 * tokens * self._active(g)
            flops += round(f)
            compute_s += f / self._rate(c.path(g.type_name)) if f else 0.0
        kv_s, kv_bytes = self._kv_seconds(batch, context, kv)
        memory_s += kv_s
        nbytes += kv_bytes
        attn = tokens * self.cost.attention_flops(1, max(context - 1, 0))
        compute_s += attn / self._rate("attn") if attn else 0.0
        fixed = c.token_s + self.n_layers * c.layer_s + self.moe_layers * c.moe_layer_s
        return Timing(fixed + max(memory_s, compute_s), compute_s, memory_s, fixed, flops + attn, nbytes)

    def prefill(self, batch: int, new: int, cached: int = 0) -> Timing:
        """Prefill ``batch`` sequences of ``new`` tokens after ``cached`` ones, in micro-batches of ``ubatch``."""
        c = self.coeff
        tokens = batch * new
        calls = max(1, math.ceil(tokens / self.ubatch))
        per_call = tokens / calls
        seconds = compute_s = memory_s = 0.0
        nbytes = flops = 0
        for g in self.all_groups:            # host weights are copied to the device per micro-batch (host_speed)
            if g.role == "head":
                continue
            f = 2 * self._active(g) * per_call
            read = self._touched(g, math.ceil(per_call))
            if self.dequant and c.path(g.type_name) == "quant" and per_call >= DEQUANT_MIN_TOKENS:
                f16 = 2 * g.n_elements * read / g.n_bytes           # the F16 copy of the touched weights
                t_c = f / self._rate("f16", g) if f else 0.0
                convert = (read + f16) / (self.bandwidth * c.bandwidth_fraction("f16"))   # read quantized, write F16
                t_m = convert + f16 / self.bandwidth                # ... and the GEMM reads it back
                seconds += calls * (convert + max(t_c, f16 / self.bandwidth))
                read += 2 * f16
            else:
                t_c = f / self._rate(c.path(g.type_name), g) if f else 0.0
                t_m = read / (self.bandwidth * self._share(g))
                seconds += calls * max(t_c, t_m)
            compute_s += calls * t_c
            memory_s += calls * t_m
            flops += round(calls * f)
            nbytes += round(calls * read)
        # logits of each sequence's last token: one mat-vec per micro-batch that ends a sequence
        for g in self.all_groups:
            if g.role == "head":
                t_m = g.n_bytes / (self.bandwidth * c.bandwidth_fraction(g.type_name))
                t_c = 2 * batch * g.n_elements / self._rate(c.path(g.type_name))
                seconds += max(t_m, t_c)
                memory_s += t_m
                nbytes += g.n_bytes
        attn = batch * self.cost.attention_flops(new, cached)
        if attn:
            t_a = attn / self._rate("attn")
            seconds += t_a
            compute_s += t_a
            flops += attn
        act = c.act_passes * 4 * self.spec.n_embd * tokens * self.n_layers
        act_s = act / self.bandwidth
        fixed = calls * self.n_layers * c.ubatch_layer_s + c.token_s
        return Timing(seconds + fixed + act_s, compute_s, memory_s + act_s, fixed, flops, nbytes + round(act))


def kernel_speed(spec, device, ubatch: int = 512, exclude: frozenset[str] = frozenset(),
                 era: str | None = None) -> KernelSpeed | None:
    """llama.cpp's speed model for ``spec`` on ``device`` (``era``: an older build's, kernels.py), or ``None``
    where the device lacks the facts (bandwidth, a peak rate) or no coefficients describe its kind."""
    if not getattr(device, "bandwidth_bytes_per_s", None):
        return None
    coeff = coefficients(device, era)
    if coeff is None or peak(device, coeff, "quant") is None:
        return None
    return KernelSpeed(spec, device, coeff, ubatch, exclude)
