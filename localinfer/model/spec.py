"""ModelSpec: what a model *is*, read once from a GGUF header and frozen.

Per-layer arrays in the file come first (``{arch}.attention.head_count_kv`` may
be an array); architecture knowledge is only a fallback, and anything that
cannot be determined is listed in ``ModelSpec.missing`` rather than guessed.
Weight bytes are always exact: they come from the tensor table.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gguf_tools import GGUFFormatError, GGUFHeader, TensorInfo
from gguf_tools.split import read_model_header
from localinfer.model.arch import MLA, Base, Routing
from localinfer.model.arch import derive as derive_arch

# Fallbacks for facts older files leave out.  Pattern n: layer il uses the
# sliding window unless (il + 1) % n == 0 (llama.cpp's set_swa_pattern).
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2, "llama4": 4}
_QK_NORM_ARCHS = {"qwen3", "qwen3moe", "gemma3", "olmo2"}
MAX_SANE_CONTEXT = 1 << 24
# Engine defaults for keys a file may omit (the one place they are defined).
DEFAULT_ROPE_BASE = 10000.0   # llama.cpp's rope_freq_base_train without {arch}.rope.freq_base
DEFAULT_RMS_EPS = 1e-6        # llama.cpp has none (it refuses llama/qwen2/qwen3 files without the key);
                              # transformers' LlamaConfig/Qwen2Config default, which converters write
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of one model.  Per-layer values are tuples of length n_layers."""

    path: str
    arch: str
    name: str
    n_layers: int
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_ff: tuple[int, ...]
    vocab_size: int
    n_ctx_train: int
    rope_freq_base: float | None
    rope_scaling: str | None
    rope_scaling_factor: float | None
    sliding_window: int | None
    swa_layers: tuple[bool, ...]
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    expert_ff: int | None
    tied_embeddings: bool
    qk_norm: bool
    file_type: int | None
    file_size: int
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    layer_bytes: tuple[int, ...] = field(repr=False)
    missing: tuple[str, ...] = ()
    chat_template: str | None = field(default=None, repr=False)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tokenizer_model: str | None = None
    rms_eps: float = DEFAULT_RMS_EPS       # {arch}.attention.layer_norm_rms_epsilon
    rope_dim: int | None = None            # {arch}.rope.dimension_count (None: the whole K head)
    rope_orig_ctx: int | None = None       # {arch}.rope.scaling.original_context_length (YaRN; None: n_ctx_train)
    rope_sections: tuple[int, ...] = ()    # {arch}.rope.dimension_sections (M-RoPE's; (): absent or unreadable)
    # ---- the architecture family's facts (localinfer.model.arch) ----
    rules: str = "attention"               # the family whose byte rules apply; "generic": none claims this arch
    kv_dims: tuple[tuple[int, int], ...] = ()   # per layer: (K, V) values a cell holds; (0, 0): no KV cache
    recurrent: tuple[bool, ...] = ()       # per layer: holds a recurrent state
    rs_dims: tuple[int, int] = (0, 0)      # (n_embd_r, n_embd_s) of one sequence in one recurrent layer
    swa_kind: str | None = None            # "standard" | "chunked" for the swa_layers
    mla: MLA | None = None                 # latent attention sizes (deepseek2)
    routing: Routing = field(default_factory=Routing)   # how MoE layers weigh their experts (gating, norm, scale, groups)
    n_layer_nextn: int = 0                 # NextN/MTP layers after the trunk: in the file, not loaded
    skipped_bytes: int = 0                 # bytes of the tensors llama.cpp skips (the NextN layers')
    rules_source: str = ""

    # ---- derived quantities -------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        """All tensor bytes in the file (what a full load maps)."""
        return sum(t.n_bytes for t in self.tensors)

    @property
    def nonlayer_bytes(self) -> int:
        return self.weight_bytes - sum(self.layer_bytes)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor of that name (a dict built once per spec: the compute graphs ask per layer)."""
        from localinfer.util.memo import spec_cache

        memo = spec_cache(self)
        if "tensors_by_name" not in memo:
            memo["tensors_by_name"] = {t.name: t for t in self.tensors}
        return memo["tensors_by_name"].get(name)

    def layer_tensors(self, il: int) -> list[TensorInfo]:
        prefix = f"blk.{il}."
        return [t for t in self.tensors if t.name.startswith(prefix)]

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def has_swa(self) -> bool:
        return bool(self.sliding_window) and any(self.swa_layers)

    @property
    def n_rot(self) -> int:
        """Head dimensions RoPE rotates (llama.cpp's n_rot): rope.dimension_count, else the whole K head."""
        return self.rope_dim or self.head_dim_k

    @property
    def rope_base(self) -> float:
        """RoPE frequency base: rope.freq_base, else llama.cpp's default 10000."""
        return self.rope_freq_base or DEFAULT_ROPE_BASE

    @property
    def rope_freq_scale(self) -> float:
        """Position scale of linear/YaRN RoPE scaling: 1 / factor (1.0 without a factor), as llama.cpp."""
        return 1.0 / self.rope_scaling_factor if self.rope_scaling_factor else 1.0

    @property
    def context_limit(self) -> int | None:
        """The longest context the model takes: its trained context, unless it declares RoPE scaling (None: no limit).

        ``fit`` and ``plan`` refuse a longer request; a model with RoPE scaling is trusted to stretch.
        """
        if not self.n_ctx_train or self.rope_scaling or self.rope_freq_scale != 1.0:
            return None
        return self.n_ctx_train

    @property
    def yarn_orig_ctx(self) -> int:
        """The context YaRN scaling starts from: rope.scaling.original_context_length, else n_ctx_train."""
        return self.rope_orig_ctx or self.n_ctx_train

    def kv_elements_per_token(self, il: int) -> tuple[int, int]:
        """(K elements, V elements) one token adds to layer il's cache (the family's rule: an MLA latent has
        no V; a recurrent layer holds no KV)."""
        return self.kv_dims[il]

    @property
    def has_recurrent(self) -> bool:
        return any(self.recurrent)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(il for il, r in enumerate(self.recurrent) if r)

    @property
    def rules_generic(self) -> bool:
        """No family claims this architecture: KV and compute follow the generic attention rules."""
        return self.rules == "generic"

    def require_weights(self) -> "ModelSpec":
        """This spec, or UnsupportedModelError for a file with no tensors to place or run (vocab-only).

        Header-only specs are fine for the maths; ``fit``, ``plan``, ``report`` and loading ask for weights.
        """
        if self.tensors:
            return self
        from localinfer.errors import UnsupportedModelError

        if self.tokenizer_model is not None:
            raise UnsupportedModelError(f"{self.path}: vocab-only file: no weights",
                                        hint="pass a full model GGUF; this one holds only a tokenizer", path=self.path)
        raise UnsupportedModelError(f"{self.path}: the file holds no tensors: no weights",
                                    hint="pass a full model GGUF", path=self.path)

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | GGUFHeader) -> "ModelSpec":
        """Build from a GGUF file (every shard of a split model) or an already-read header.

        Raises GGUFFormatError when the metadata contradicts itself or the tensors.
        """
        header = source if isinstance(source, GGUFHeader) else read_model_header(source)
        return _build(header)


def _err(header: GGUFHeader, key: str, message: str, hint: str | None = None, **facts) -> GGUFFormatError:
    return GGUFFormatError(message, field=key, path=header.path,
                           hint=hint or "the file's metadata is inconsistent; re-download or re-convert it", **facts)


def _missing(header: GGUFHeader, key: str, message: str, hint: str | None = None) -> GGUFFormatError:
    """A key a model needs is absent: the file may be a valid GGUF of another kind (``facts['missing']``)."""
    return _err(header, key, message, hint or "is this a complete model? `localinfer inspect` shows what the file holds",
                missing=True)


def _int(header: GGUFHeader, key: str, *, default: Any = None, allow_zero: bool = False) -> Any:
    v = header.kv.get(key, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(header, key, f"{key} should be an integer, found {type(v).__name__}")
    if v < 0 or (v == 0 and not allow_zero):
        raise _err(header, key, f"{key} is {v}; it must be positive")
    return v


def _sections(v: Any) -> tuple[int, ...]:
    """rope.dimension_sections as llama.cpp's loader takes it (``get_key_or_arr`` with n = 4): four integers, or
    one that fills all four; () for a value it would not take: only the architectures that read it refuse such a
    file, and fit does not need it to place or size one."""
    def ok(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0
    if isinstance(v, list) and len(v) == 4 and all(ok(x) for x in v):
        return tuple(v)
    return (v,) * 4 if ok(v) else ()


def _per_layer(header: GGUFHeader, key: str, n_layers: int, default: Any = None) -> tuple[int, ...] | None:
    """A per-layer value that may be stored as a scalar or an array of length n_layers."""
    v = header.kv.get(key)
    if v is None:
        return None if default is None else (default,) * n_layers
    if isinstance(v, list):
        if len(v) != n_layers or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise _err(header, key, f"{key} is an array of {len(v)} values; expected {n_layers} non-negative integers")
        return tuple(v)
    return (_int(header, key, allow_zero=True),) * n_layers


# general.type values of GGUFs that are not models: (what it is, what to pass instead)
NOT_A_MODEL = {
    "adapter": ("LoRA adapter: not a model", "pass the base model's GGUF; adapters are applied on top of it"),
    "mmproj": ("multimodal projector: not a model", "pass the language model's GGUF; the projector goes with it"),
    "vocab": ("vocab-only file: no weights", "pass a full model GGUF; this one holds only a tokenizer"),
}


def _build(h: GGUFHeader) -> ModelSpec:
    missing: list[str] = []
    arch = h.kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _missing(h, "general.architecture", "general.architecture is missing; this is not a model file",
                   hint="is this a LoRA adapter, a vocab-only file or a projector? pass a full model GGUF")
    kind = h.kv.get("general.type")
    if kind in NOT_A_MODEL:
        what, hint = NOT_A_MODEL[kind]
        raise _err(h, "general.type", what, hint=hint, missing=True)
    a = arch + "."

    layer_bytes: dict[int, int] = defaultdict(int)
    max_layer = -1
    for t in h.tensors:
        m = _LAYER_RE.match(t.name)
        if m:
            il = int(m.group(1))
            layer_bytes[il] += t.n_bytes
            max_layer = max(max_layer, il)

    n_layers = _int(h, a + "block_count")
    if n_layers is None:
        if max_layer < 0:
            raise _missing(h, a + "block_count", f"{a}block_count is missing and no blk.N tensors exist")
        n_layers = max_layer + 1
        missing.append(f"{a}block_count (counted {n_layers} from tensors)")
    if n_layers > 100_000:
        raise _err(h, a + "block_count", f"{a}block_count is {n_layers}, which is absurd")
    if max_layer >= n_layers:
        raise _err(h, a + "block_count",
                   f"{a}block_count is {n_layers} but tensor blk.{max_layer}.* exists")
    if max_layer >= 0:
        empty = next((il for il in range(n_layers) if il not in layer_bytes), None)
        if empty is not None:
            raise _err(h, a + "block_count",
                       f"{a}block_count is {n_layers} but the file has no blk.{empty}.* tensors")

    # NextN/MTP layers follow the trunk; llama.cpp skips their tensors and caches (llama-model.cpp load_hparams:
    # n_layer() = block_count - nextn_predict_layers; TENSOR_SKIP without load_mtp)
    n_all = n_layers
    n_nextn = _int(h, a + "nextn_predict_layers", default=0, allow_zero=True)
    if n_nextn >= n_all:
        raise _err(h, a + "nextn_predict_layers", f"{a}nextn_predict_layers is {n_nextn} of {n_all} layers")
    n_layers = n_all - n_nextn
    tensors = [t for t in h.tensors if not (_LAYER_RE.match(t.name) and int(_LAYER_RE.match(t.name).group(1)) >= n_layers)]
    skipped = sum(t.n_bytes for t in h.tensors) - sum(t.n_bytes for t in tensors)

    tok = h.tensor("token_embd.weight")
    n_embd = _int(h, a + "embedding_length")
    if n_embd is None:
        if tok is None:
            raise _missing(h, a + "embedding_length", f"{a}embedding_length is missing")
        n_embd = tok.shape[0]
    if tok is not None and tok.shape[0] != n_embd:
        raise _err(h, a + "embedding_length",
                   f"{a}embedding_length is {n_embd} but token_embd.weight rows have {tok.shape[0]} values")

    n_head = _per_layer(h, a + "attention.head_count", n_all)
    if n_head is None:
        raise _missing(h, a + "attention.head_count", f"{a}attention.head_count is missing")
    n_head = n_head[:n_layers]
    n_head_kv = (_per_layer(h, a + "attention.head_count_kv", n_all) or n_head)[:n_layers]
    first_attn = next((il for il in range(n_layers) if n_head[il]), 0)
    default_hd = n_embd // n_head[first_attn] if n_head[first_attn] else 0
    head_dim_k = _int(h, a + "attention.key_length", default=default_hd)
    head_dim_v = _int(h, a + "attention.value_length", default=head_dim_k)

    n_ff = _per_layer(h, a + "feed_forward_length", n_all)
    if n_ff is None:
        n_ff = (0,) * n_layers
        missing.append(f"{a}feed_forward_length")
    n_ff = n_ff[:n_layers]

    vocab = _int(h, a + "vocab_size")
    tokens = h.kv.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(s, str) for s in tokens[:16])):
        raise _err(h, "tokenizer.ggml.tokens", "tokenizer.ggml.tokens must be an array of strings")
    if vocab is None:
        if tok is not None:
            vocab = tok.shape[1] if len(tok.shape) > 1 else 0
        elif tokens is not None:
            vocab = len(tokens)
        else:
            vocab = 0
            missing.append("vocab size")
    if vocab is not None and tok is not None and len(tok.shape) > 1 and vocab != tok.shape[1]:
        raise _err(h, a + "vocab_size", f"{a}vocab_size is {vocab} but token_embd.weight has {tok.shape[1]} rows")
    if tokens is not None and tokens and tok is not None and len(tok.shape) > 1 and len(tokens) != tok.shape[1]:
        raise _err(h, "tokenizer.ggml.tokens",
                   f"the tokenizer has {len(tokens)} tokens but token_embd.weight has {tok.shape[1]} rows")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        arr = h.kv.get(key)
        if arr is not None and tokens is not None and (not isinstance(arr, list) or len(arr) != len(tokens)):
            n = len(arr) if isinstance(arr, list) else 1
            raise _err(h, key, f"{key} has {n} entries; the tokenizer has {len(tokens)} tokens")

    n_ctx_train = _int(h, a + "context_length")
    if n_ctx_train is None:
        n_ctx_train = 0
        missing.append(f"{a}context_length")
    elif n_ctx_train > MAX_SANE_CONTEXT:
        raise _err(h, a + "context_length", f"{a}context_length is {n_ctx_train}, which is absurd")

    sliding = h.kv.get(a + "attention.sliding_window")
    if isinstance(sliding, bool) or not isinstance(sliding, (int, type(None))) or (sliding is not None and sliding < 0):
        raise _err(h, a + "attention.sliding_window", f"{a}attention.sliding_window must be a non-negative integer")
    sliding = sliding or None
    pattern = h.kv.get(a + "attention.sliding_window_pattern")
    pattern_unknown = False
    if sliding is None:
        swa_layers = (False,) * n_layers
    elif isinstance(pattern, list):
        if len(pattern) not in (n_layers, n_all):
            raise _err(h, a + "attention.sliding_window_pattern",
                       f"sliding_window_pattern has {len(pattern)} entries, expected {n_all}")
        swa_layers = tuple(bool(x) for x in pattern[:n_layers])
    else:
        period = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else _SWA_PERIOD.get(arch)
        if period:
            swa_layers = tuple((il + 1) % period != 0 for il in range(n_layers))
        else:
            swa_layers, pattern_unknown = (False,) * n_layers, True

    facts = derive_arch(h, Base(arch, n_layers, n_embd, n_head, n_head_kv, n_ff, head_dim_k, head_dim_v, sliding,
                                swa_layers), lambda key, message: _err(h, key, message))
    sliding = facts.sliding_window
    if facts.swa_layers is not None:
        swa_layers = facts.swa_layers
    elif pattern_unknown:          # a window but no layer pattern, and the family names none
        if arch not in ("qwen2", "qwen3", "llama", "qwen3moe", "qwen2moe"):
            missing.append("sliding-window layer pattern (assumed no SWA layers)")
        sliding = None
    if facts.rules == "generic":
        missing.append(f"architecture {arch!r} is not one localinfer knows; KV and compute estimates use generic rules")

    n_expert = _int(h, a + "expert_count", default=0, allow_zero=True)
    n_expert_used = _int(h, a + "expert_used_count", default=0, allow_zero=True)
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise _err(h, a + "expert_used_count", f"expert_used_count {n_expert_used} with {n_expert} experts")
    n_expert_shared = _int(h, a + "expert_shared_count", default=0, allow_zero=True)
    expert_ff = _int(h, a + "expert_feed_forward_length")
    routing = _routing(h, a)

    rope_base = h.kv.get(a + "rope.freq_base")
    rope_scaling = h.kv.get(a + "rope.scaling.type")
    rope_factor = h.kv.get(a + "rope.scaling.factor", h.kv.get(a + "rope.scale_linear"))   # older key second
    rms_eps = h.kv.get(a + "attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS)
    if isinstance(rms_eps, bool) or not isinstance(rms_eps, (int, float)) or not 0 < rms_eps < 1:
        raise _err(h, a + "attention.layer_norm_rms_epsilon",
                   f"{a}attention.layer_norm_rms_epsilon is {rms_eps!r}; it must be a number between 0 and 1")

    tmpl = h.kv.get("tokenizer.chat_template")
    return ModelSpec(
        path=h.path,
        arch=arch,
        name=str(h.kv.get("general.name") or os.path.basename(h.path)),
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_ff=n_ff,
        vocab_size=vocab,
        n_ctx_train=n_ctx_train,
        rope_freq_base=float(rope_base) if isinstance(rope_base, (int, float)) else None,
        rope_scaling=rope_scaling if isinstance(rope_scaling, str) and rope_scaling != "none" else None,
        rope_scaling_factor=float(rope_factor) if isinstance(rope_factor, (int, float)) and rope_factor else None,
        sliding_window=sliding,
        swa_layers=swa_layers,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_expert_shared=n_expert_shared,
        expert_ff=expert_ff,
        tied_embeddings=h.tensor("output.weight") is None,
        qk_norm=h.tensor("blk.0.attn_q_norm.weight") is not None or (arch in _QK_NORM_ARCHS and not h.tensors),
        file_type=h.kv.get("general.file_type") if isinstance(h.kv.get("general.file_type"), int) else None,
        file_size=h.file_size,
        tensors=tuple(tensors),
        layer_bytes=tuple(layer_bytes.get(il, 0) for il in range(n_layers)),
        missing=tuple(missing),
        chat_template=tmpl if isinstance(tmpl, str) else None,
        bos_token_id=h.kv.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=h.kv.get("tokenizer.ggml.eos_token_id"),
        tokenizer_model=h.kv.get("tokenizer.ggml.model"),
        rms_eps=float(rms_eps),
        rope_dim=_int(h, a + "rope.dimension_count"),
        rope_orig_ctx=_int(h, a + "rope.scaling.original_context_length"),
        rope_sections=_sections(h.kv.get(a + "rope.dimension_sections")),
        rules=facts.rules,
        kv_dims=facts.kv_dims,
        recurrent=facts.recurrent,
        rs_dims=facts.rs_dims,
        swa_kind=facts.swa_kind if sliding else None,
        mla=facts.mla,
        routing=routing,
        n_layer_nextn=n_nextn,
        skipped_bytes=skipped,
        rules_source=facts.source,
    )


def _routing(h: GGUFHeader, a: str) -> Routing:
    """The MoE routing keys (llama-model.cpp load_hparams and the arch loaders; absent keys: llama.cpp's defaults)."""
    scale = h.kv.get(a + "expert_weights_scale", 0.0)
    return Routing(gating=_int(h, a + "expert_gating_func", default=0, allow_zero=True),
                   weights_norm=bool(h.kv.get(a + "expert_weights_norm", False)),
                   weights_scale=float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else 0.0,
                   n_groups=_int(h, a + "expert_group_count", default=0, allow_zero=True),
                   n_group_used=_int(h, a + "expert_group_used_count", default=0, allow_zero=True),
                   n_dense_lead=_int(h, a + "leading_dense_block_count", default=0, allow_zero=True))
