"""MLXEngine: the engine contract on MLX (Apple GPU, or the CPU elsewhere).

Weights come from the GGUF (see ``weights``), layers from mlx-lm, tokens from
llama.cpp's vocabulary code, and each sequence has its own preallocated
mlx-lm cache (see ``kv``).  ``eval`` runs the transformer over the new tokens
and applies the output head only to the hidden states whose logits were asked.

Compute dtype: ``plan.dtype`` if given, else float16 on the GPU (bfloat16 for
BF16 files) and float32 on the CPU, where MLX's half-precision kernels are
several times slower.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten

from gguf_tools import read_header
from localinfer.backends.engine import Engine, LoadPlan
from localinfer.backends.llamacpp.native import check_readable
from localinfer.backends.mlx import kv
from localinfer.backends.mlx.memory import mlx_weight_bytes
from localinfer.backends.mlx.model import build_model, check_supported, head
from localinfer.backends.mlx.weights import DTYPE_NAMES, load_weights
from localinfer.backends.vocab import VocabOnly
from localinfer.errors import BackendUnavailableError, DoesNotFitError, LocalinferError, UsageError
from localinfer.model.spec import ModelSpec
from localinfer.units import fmt_bytes

log = logging.getLogger("localinfer.mlx")

DTYPES = {"f16": mx.float16, "fp16": mx.float16, "float16": mx.float16,
          "bf16": mx.bfloat16, "bfloat16": mx.bfloat16,
          "f32": mx.float32, "fp32": mx.float32, "float32": mx.float32}


def gpu_available() -> bool:
    """Whether MLX can use a Metal GPU here."""
    metal = getattr(mx, "metal", None)
    return bool(metal is not None and metal.is_available())


def working_set_limit() -> int | None:
    """Metal's recommended working-set size in bytes (None off Apple Silicon)."""
    if not gpu_available():
        return None
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    limit = info.get("max_recommended_working_set_size")
    return int(limit) if limit else None


def check_working_set(needed: int, limit: int | None, force: bool) -> None:
    """Refuse a load that would exceed the GPU working set, unless forced."""
    if limit is not None and needed > limit and not force:
        raise DoesNotFitError(
            f"weights and KV cache need {fmt_bytes(needed)}, above the GPU working-set limit of {fmt_bytes(limit)}",
            needed=needed, available=limit,
            hint="use a smaller --ctx, a quantized KV cache (-ctk q8_0 -ctv q8_0), a smaller quant, or --force")


def pick_device(plan: LoadPlan) -> mx.Device:
    want = (plan.device or "").lower()
    if want in ("", "auto"):
        return mx.gpu if gpu_available() else mx.cpu
    if want in ("gpu", "metal", "mps"):
        if not gpu_available():
            raise BackendUnavailableError("MLX has no Metal GPU on this machine", hint="use --device cpu")
        return mx.gpu
    if want == "cpu":
        return mx.cpu
    raise UsageError(f"the mlx backend has no device {plan.device!r}", flag="--device", hint="use cpu or gpu")


def pick_dtype(plan: LoadPlan, spec: ModelSpec, device: mx.Device) -> mx.Dtype:
    if plan.dtype:
        try:
            return DTYPES[plan.dtype.lower()]
        except KeyError:
            raise UsageError(f"the mlx backend has no dtype {plan.dtype!r}", flag="--dtype",
                             hint="use f16, bf16 or f32") from None
    if device == mx.cpu:
        return mx.float32
    return mx.bfloat16 if any(t.type == T.BF16 for t in spec.tensors) else mx.float16


class MLXEngine(Engine):
    """One GGUF model run by mlx-lm's layers, with ``plan.n_seq`` caches."""

    name = "mlx"

    def __init__(self, plan: LoadPlan):
        super().__init__(plan)
        self.model = None
        self._caches: list[list] = []
        self._vocab = None
        header = read_header(check_readable(plan.model_path))
        self.spec = spec = ModelSpec.from_gguf(header)
        check_supported(spec)
        kv.check_types(spec, plan.type_k, plan.type_v)
        self.device = pick_device(plan)
        mx.set_default_device(self.device)
        self.dtype = pick_dtype(plan, spec, self.device)
        self.n_ctx = max(1, plan.n_ctx // plan.n_seq)
        self.kv_capacity = kv.capacity(self.n_ctx)
        self.planned_bytes = {
            "weights": mlx_weight_bytes(spec, DTYPE_NAMES[self.dtype]),   # what `fit --backend mlx` predicts
            "kv": plan.n_seq * self.kv_capacity * kv.bytes_per_token(spec, plan.type_k, plan.type_v),
        }
        check_working_set(sum(self.planned_bytes.values()), working_set_limit(), bool(plan.options.get("force")))
        self._vocab = VocabOnly(spec.path)
        try:
            weights = load_weights(spec, self.dtype)
            self.notes = list(weights.notes)
            for note in self.notes:
                log.warning(note)
            self.model = build_model(spec, weights)
            del weights
            self._caches = [kv.make_cache(spec, plan.type_k, plan.type_v, self.n_ctx) for _ in range(plan.n_seq)]
        except BaseException:
            self.close()
            raise
        self.n_vocab = spec.vocab_size
        self.bos_id = self._vocab.bos_id
        self.eos_ids = self._vocab.eos_ids
        self.add_bos = self._vocab.add_bos
        mx.reset_peak_memory()

    # ---- tokenizer ---------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self._vocab.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self._vocab.token_bytes(token)

    def token_text(self, token: int) -> str:
        """A token's vocabulary text, special tokens included."""
        return self._vocab.token_text(token)

    # ---- KV cache ----------------------------------------------------------
    def _seq(self, seq: int) -> list:
        if self.model is None:
            raise LocalinferError("this engine is closed")
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} outside 0..{self.n_seq - 1}")
        return self._caches[seq]

    def kv_len(self, seq: int = 0) -> int:
        return self._seq(seq)[0].offset

    def _trim(self, n: int, seq: int) -> None:
        for c in self._seq(seq):
            c.trim(c.offset - n)

    # ---- evaluation --------------------------------------------------------
    def forward(self, tokens: Sequence[int], logits_at: Sequence[int], seq: int = 0) -> mx.array | None:
        """Append tokens to seq's cache; lazy logits [len(logits_at), n_vocab] in the compute dtype."""
        caches = self._seq(seq)
        hidden = self.model.model(mx.array([[int(t) for t in tokens]], dtype=mx.int32), cache=caches)
        if not logits_at:
            mx.eval(hidden, [(c.keys, c.values) for c in caches])
            return None
        rows = hidden[0] if len(logits_at) == len(tokens) and list(logits_at) == list(range(len(tokens))) \
            else hidden[0, mx.array([int(i) for i in logits_at], dtype=mx.int32)]
        return head(self.model, rows)

    def _eval_chunk(self, tokens, start, logits_at, seq):
        logits = self.forward(tokens, logits_at, seq)
        if logits is None:
            return None
        return np.array(logits.astype(mx.float32), copy=False)

    # ---- resources ---------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes in use: weights and kv (allocated arrays), compute (peak MLX memory above them since load)."""
        if self.model is None:
            raise LocalinferError("this engine is closed")
        weights = sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))
        cache = sum(kv.cache_bytes(c) for c in self._caches)
        peak = mx.get_peak_memory()
        return {"weights": weights, "kv": cache, "compute": max(0, peak - weights - cache) if peak else 0}

    def close(self) -> None:
        self.model = None
        self._caches = []
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        mx.clear_cache()
