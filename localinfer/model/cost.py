"""What one model costs per token: FLOPs and bytes read, from its tensor table.

``D_w`` is the weight bytes a decode step reads once (everything but a
row-looked-up embedding; only the touched experts of an MoE), ``k`` the KV bytes
per token, ``F`` the FLOPs of one token.  Prefill of ``c`` new tokens after ``h``
cached ones costs ``2·N·c`` matrix FLOPs plus attention over the causal pairs
``c·h + c(c+1)/2``.  ``localinfer.plan.speed`` turns these into seconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache

from localinfer.errors import UsageError
from localinfer.model.kv import KV_TYPES, check_kv_type, recurrent_state_bytes, row_bytes
from localinfer.model.spec import ModelSpec
from localinfer.util.memo import spec_cache

_LAYER_RE = re.compile(r"^blk\.\d+\.")
DEFAULT_UBATCH = 512
__all__ = ["KV_TYPES", "ModelCost", "attention_pairs", "ceil_div", "kv_pair", "model_cost", "rounds_needed"]


def kv_pair(kv: str | tuple[str, str], flag: str = "--kv") -> tuple[str, str]:
    """``"q8_0"`` or ``("q8_0", "f16")`` as (type_k, type_v), checked against budget.KV_TYPES."""
    pair = (kv, kv) if isinstance(kv, str) else tuple(kv)
    if len(pair) != 2:
        raise UsageError(f"a KV type is one name or a (K, V) pair, got {kv!r}", flag=flag)
    return check_kv_type(pair[0], flag), check_kv_type(pair[1], flag)


def attention_pairs(new: int, cached: int = 0, window: int | None = None) -> int:
    """Causal (query, key) pairs when ``new`` tokens follow ``cached`` ones: c·h + c(c+1)/2.

    With a sliding window ``w`` each query sees at most ``w`` keys.
    """
    full = new * cached + new * (new + 1) // 2
    if not window or cached + new <= window:
        return full
    # positions p = cached+1 .. cached+new see min(p, w) keys
    below = max(0, min(window, cached + new) - cached)        # queries with p <= w
    first = cached + 1
    return (below * (first + first + below - 1)) // 2 + (new - below) * window


@dataclass(frozen=True)
class ModelCost:
    """Per-token work and bytes of one model, taken from its tensor table (integer bytes)."""

    name: str
    weight_bytes: int            # every tensor in the file
    dense_read_bytes: int        # read once per decode step whatever the batch
    expert_bytes: int            # routed experts, read as far as tokens touch them
    n_expert: int
    n_expert_used: int
    matmul_params: int           # multiply-accumulates per token in the layers (active experts only)
    head_params: int             # output projection (logits)
    layer_pair_flops: tuple[int, ...] = field(repr=False)   # FLOPs per (query, key) pair, per layer
    layer_windows: tuple[int | None, ...] = field(repr=False)
    layer_kv_elems: tuple[tuple[int, int], ...] = field(repr=False)  # (K, V) values per token per layer
    state_bytes: int = 0         # a hybrid's recurrent state per sequence (F32 r and s rows, all its layers)

    def decode_read_bytes(self, batch: int = 1) -> int:
        """D_w: weight bytes one decode step reads for ``batch`` tokens.

        Routed experts are counted as far as uniformly routed tokens touch them:
        a fraction 1 − (1 − k/n)^b of each layer's experts.
        """
        if not self.n_expert or not self.expert_bytes:
            return self.dense_read_bytes
        untouched = (1 - self.n_expert_used / self.n_expert) ** max(batch, 1)
        return self.dense_read_bytes + round(self.expert_bytes * (1 - untouched))

    def kv_token_bytes(self, kv: str | tuple[str, str] = "f16") -> int:
        """k: KV bytes one token adds (all layers, K and V), ignoring sliding windows."""
        return sum(_layer_rows(kv_pair(kv), self.layer_kv_elems))

    def kv_read_bytes(self, context: int, kv: str | tuple[str, str] = "f16") -> int:
        """KV bytes one request reads per decode step at ``context`` tokens (windows applied)."""
        rows = _layer_rows(kv_pair(kv), self.layer_kv_elems)
        if not any(self.layer_windows):
            return sum(rows) * context
        return sum(r * (min(context, w) if w else context) for r, w in zip(rows, self.layer_windows))

    def attention_flops(self, new: int, cached: int = 0) -> int:
        """Attention FLOPs (QKᵀ and PV) of ``new`` tokens after ``cached`` ones, one sequence."""
        if not any(self.layer_windows):
            return sum(self.layer_pair_flops) * attention_pairs(new, cached)
        return sum(f * attention_pairs(new, cached, w) for f, w in zip(self.layer_pair_flops, self.layer_windows))

    def token_flops(self, context: int) -> int:
        """F: FLOPs of one decode token at ``context`` (matrices, logits, attention)."""
        return 2 * (self.matmul_params + self.head_params) + self.attention_flops(1, max(context - 1, 0))

    def prefill_flops(self, new: int, cached: int = 0) -> int:
        """FLOPs to prefill one sequence: 2·N·c + attention pairs + logits of the last token."""
        if new <= 0:
            return 0
        return 2 * self.matmul_params * new + self.attention_flops(new, cached) + 2 * self.head_params

    def step_bytes(self, batch: int, context: int, kv: str | tuple[str, str] = "f16") -> int:
        """D(b, L) = D_w + b·L·k (+ b·2·S for a recurrent state S, read and written each step): bytes one decode
        step moves for ``batch`` requests at ``context``."""
        return self.decode_read_bytes(batch) + batch * (self.kv_read_bytes(context, kv) + 2 * self.state_bytes)

    def per_token_read_bytes(self, batch: int, context: int, kv: str | tuple[str, str] = "f16") -> float:
        """d(b, L) = D_w/b + L·k: bytes read per output token."""
        return self.step_bytes(batch, context, kv) / batch

    def kv_weight_crossover(self, context: int, kv: str | tuple[str, str] = "f16") -> int:
        """b_KV = ⌈D_w / (L·k)⌉: smallest batch whose KV reads reach the shared weight read."""
        per_request = self.kv_read_bytes(context, kv)
        if per_request <= 0:
            raise UsageError("context must be at least one token", flag="--ctx")
        return -(-self.decode_read_bytes(1) // per_request)


@lru_cache(maxsize=256)
def _layer_rows(kv: tuple[str, str], elems: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Bytes one token adds to each layer's K and V rows."""
    tk, tv = kv
    return tuple((row_bytes(tk, ek) if ek else 0) + (row_bytes(tv, ev) if ev else 0) for ek, ev in elems)


def model_cost(spec: ModelSpec) -> ModelCost:
    """Work and bytes per token of the model ``spec`` describes (memoised per spec)."""
    memo = spec_cache(spec)
    if "model_cost" not in memo:
        memo["model_cost"] = _build_cost(spec)
    return memo["model_cost"]


def _build_cost(spec: ModelSpec) -> ModelCost:
    embd = spec.tensor("token_embd.weight")
    out = spec.tensor("output.weight")
    dense = expert = matmul = 0
    for t in spec.tensors:
        if t.name == "token_embd.weight":
            continue                        # looked up by row, never read whole
        is_expert = "_exps." in t.name
        if is_expert:
            expert += t.n_bytes
        else:
            dense += t.n_bytes
        if _LAYER_RE.match(t.name) and len(t.shape) >= 2:
            if is_expert and spec.n_expert:
                matmul += t.n_elements // spec.n_expert * spec.n_expert_used
            else:
                matmul += t.n_elements
    head = out if out is not None else embd
    if out is None and embd is not None:
        dense += embd.n_bytes               # tied embeddings: the head reads the whole table
    pair_flops, windows, elems = [], [], []
    for il in range(spec.n_layers):
        hq = spec.n_head[il] if spec.kv_dims[il] != (0, 0) else 0     # recurrent layers attend to nothing
        pair_flops.append(2 * hq * (spec.head_dim_k + spec.head_dim_v) if hq else 0)
        swa = spec.has_swa and spec.swa_layers[il]
        windows.append(spec.sliding_window if swa else None)
        ek, ev = spec.kv_elements_per_token(il)
        elems.append((ek, ev))
    return ModelCost(
        name=spec.name,
        weight_bytes=spec.weight_bytes,
        dense_read_bytes=dense,
        expert_bytes=expert,
        n_expert=spec.n_expert,
        n_expert_used=spec.n_expert_used,
        matmul_params=matmul,
        head_params=head.n_elements if head is not None else 0,
        layer_pair_flops=tuple(pair_flops),
        layer_windows=tuple(windows),
        layer_kv_elems=tuple(elems),
        state_bytes=recurrent_state_bytes(spec, 1),
    )


def rounds_needed(tokens: int, per_round: float) -> int:
    """Rounds to produce ``tokens`` when each yields ``per_round`` on average (at least 1 each)."""
    if tokens <= 0:
        return 0
    return max(1, math.ceil(tokens / max(per_round, 1.0) - 1e-9))


def decode_weight_bytes(spec: ModelSpec, *, active_experts_only: bool = True) -> int:
    """Weight bytes read per decode step: every tensor but the embedding lookup table.

    With tied embeddings the table is also the output projection, so it is read.
    MoE: only the routed experts' share of expert tensors (n_used / n_expert).
    """
    total = 0
    for t in spec.tensors:
        if t.name == "token_embd.weight" and not spec.tied_embeddings:
            continue
        if active_experts_only and spec.n_expert and "_exps." in t.name:
            total += t.n_bytes * spec.n_expert_used // spec.n_expert
        else:
            total += t.n_bytes
    return total
