"""Byte rules per architecture family: which layers hold a KV cache and of what width, the recurrent state,
the sliding/chunked window, and the shape checks a file must pass — each family in its own module, naming the
llama.cpp source it follows (docs/memory.md, "Architectures").

``ModelSpec.from_gguf`` reads the generic facts (:class:`Base`), then asks the family of the file's
architecture for the rest (:class:`ArchFacts`).  An architecture no family claims gets the attention rules,
labelled ``generic``: its KV is counted as llama's (every layer, K and V of ``head_count_kv`` heads) and ``fit``
says so.  A family checks shapes only where llama.cpp would refuse the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from gguf_tools import GGUFHeader


@dataclass(frozen=True)
class Base:
    """What every architecture's header gives, read before the family speaks (per-layer tuples: trunk layers)."""

    arch: str
    n_layers: int                 # trunk layers (block_count less the NextN/MTP layers)
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    n_ff: tuple[int, ...]
    head_dim_k: int               # attention.key_length (default n_embd / n_head)
    head_dim_v: int
    sliding_window: int | None
    swa_layers: tuple[bool, ...]

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (deepseek2): the cache holds one latent of kv_lora_rank + rope dims per token."""

    kv_lora_rank: int
    q_lora_rank: int              # 0: a plain attn_q (V2-Lite)
    head_dim_k: int               # the real query/key head (nope + rope), key_length_mla
    head_dim_v: int               # the real value head, value_length_mla
    n_rot: int
    temperature: bool = False     # attention.temperature_scale set (Mistral-Large): queries scaled per position


@dataclass(frozen=True)
class Routing:
    """How a MoE layer weighs its experts (llama-hparams.h; read in llama-model.cpp and the arch's loader).

    ``gating`` is llama.cpp's expert_gating_func (0: none written, the graph's arch default; 1 softmax,
    2 sigmoid, 3 softmax over the chosen weights, 4 sqrt-softplus); ``weights_scale`` 0 or 1 scales nothing;
    ``n_groups`` > 1 turns on group-limited routing (``n_group_used`` groups kept)."""

    gating: int = 0
    weights_norm: bool = False
    weights_scale: float = 0.0
    n_groups: int = 0
    n_group_used: int = 0
    n_dense_lead: int = 0         # leading_dense_block_count: the first layers run a dense FFN


@dataclass(frozen=True)
class ArchFacts:
    """What a family adds: the cache layout per trunk layer and the recurrent state."""

    rules: str                                   # the family's name ("attention", "mla", "hybrid"; "generic")
    kv_dims: tuple[tuple[int, int], ...]         # per layer: (K, V) values one cell holds; (0, 0): no KV cache
    recurrent: tuple[bool, ...]                  # per layer: holds a recurrent state (r and s rows per sequence)
    rs_dims: tuple[int, int] = (0, 0)            # (n_embd_r, n_embd_s): values of one sequence's r and s rows
    swa_kind: str | None = None                  # "standard" or "chunked" for the swa_layers; None: no window
    sliding_window: int | None = None
    swa_layers: tuple[bool, ...] | None = None   # None: the Base's
    mla: MLA | None = None
    source: str = ""                             # the llama.cpp source the rules follow

    @property
    def has_recurrent(self) -> bool:
        return any(self.recurrent)


Err = Callable[..., Exception]      # err(key, message) -> the exception to raise (GGUFFormatError)


class Family(Protocol):
    ARCHS: tuple[str, ...]

    def derive(self, h: GGUFHeader, b: Base, err: Err) -> ArchFacts: ...


def get_int(h: GGUFHeader, key: str, err: Err, default: Any = None) -> Any:
    """A non-negative integer key (default when absent); err naming the key otherwise."""
    v = h.kv.get(key, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise err(key, f"{key} is {v!r}; it must be a non-negative integer")
    return v


def per_layer_flags(h: GGUFHeader, key: str, n_all: int, n: int, err: Err) -> tuple[bool, ...] | None:
    """A per-layer boolean/int array key (``attention.recurrent_layers``) cut to the trunk; None when absent."""
    v = h.kv.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != n_all:
        raise err(key, f"{key} should be an array of {n_all} values")
    return tuple(bool(x) for x in v[:n])


def check_out(h: GGUFHeader, name: str, want: int, meta: str, err: Err, key: str) -> None:
    """A matrix's output dimension (shape[1]) must be ``want`` when the tensor is there (llama.cpp's
    create_tensor refuses any other shape)."""
    t = h.tensor(name)
    if t is not None and len(t.shape) >= 2 and t.shape[1] != want:
        raise err(key, f"{name} has {t.shape[1]} outputs; metadata implies {meta}")


_FAMILIES: dict[str, Family] = {}


def _load() -> None:
    if _FAMILIES:
        return
    from . import attention, hybrid, mla

    for fam in (attention, mla, hybrid):
        for arch in fam.ARCHS:
            _FAMILIES[arch] = fam


def family_for(arch: str) -> Family | None:
    """The family module that claims ``arch``, or None (the generic attention rules then apply)."""
    _load()
    return _FAMILIES.get(arch)


def known_archs() -> tuple[str, ...]:
    _load()
    return tuple(_FAMILIES)


def derive(h: GGUFHeader, b: Base, err: Err) -> ArchFacts:
    """The family's facts for this file, or the generic attention rules labelled ``generic``."""
    from dataclasses import replace

    from . import attention

    fam = family_for(b.arch)
    if fam is None:
        return replace(attention.derive(h, b, err), rules="generic")
    return fam.derive(h, b, err)
