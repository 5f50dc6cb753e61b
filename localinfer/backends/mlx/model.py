"""Build an mlx-lm model (llama, qwen2, qwen3) from a ModelSpec and GGUF weights.

The layers are mlx-lm's own; this module only fills their ``ModelArgs`` from
the ModelSpec (which parses the header's norm and RoPE keys), turns the
modules whose weights arrived quantized into ``QuantizedLinear`` /
``QuantizedEmbedding`` (per module: Q8_0 token embeddings next to Q4_1 layers
are common), and loads the arrays strictly.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx import nn

from localinfer.backends.mlx.weights import LoadedWeights
from localinfer.backends.mlx.support import SUPPORTED_ARCHS, _refuse, check_supported  # noqa: F401
from localinfer.model.spec import ModelSpec

def model_args(spec: ModelSpec, weights: LoadedWeights):
    """mlx-lm ``ModelArgs`` of spec's architecture."""
    module = importlib.import_module(f"mlx_lm.models.{spec.arch}")
    params = {
        "model_type": spec.arch,
        "hidden_size": spec.n_embd,
        "num_hidden_layers": spec.n_layers,
        "intermediate_size": spec.n_ff[0],
        "num_attention_heads": spec.n_head[0],
        "num_key_value_heads": spec.n_head_kv[0],
        "head_dim": spec.head_dim_k,
        "rms_norm_eps": spec.rms_eps,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.n_ctx_train or 4096,
        "rope_theta": spec.rope_base,
        "rope_scaling": {"type": "linear", "factor": spec.rope_scaling_factor}   # llama.cpp: no type means linear
        if spec.rope_scaling in (None, "linear") and spec.rope_scaling_factor else None,
        "tie_word_embeddings": "lm_head.weight" not in weights.arrays,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights.arrays,
    }
    return module, module.ModelArgs.from_dict(params)


class FrequencyFactorRoPE(nn.Module):
    """Half-split RoPE with per-dimension period factors (GGUF ``rope_freqs.weight``, Llama 3.x)."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def build_model(spec: ModelSpec, weights: LoadedWeights) -> nn.Module:
    """An mlx-lm model with weights loaded and evaluated."""
    module, args = model_args(spec, weights)
    model = module.Model(args)
    quantized = weights.quantized
    nn.quantize(model, class_predicate=lambda path, _m: quantized.get(path, False))
    try:
        model.load_weights(list(weights.arrays.items()), strict=True)
    except ValueError as exc:
        raise _refuse(f"its tensors do not match mlx-lm's {spec.arch} module ({exc})", arch=spec.arch) from None
    factors = weights.extra.get("rope_freqs.weight")
    if factors is not None:
        for layer in model.layers:
            layer.self_attn.rope = FrequencyFactorRoPE(spec.head_dim_k, args.rope_theta, factors)
    model.eval()
    mx.eval(model.parameters())
    return model


def head(model: nn.Module, hidden: mx.array) -> mx.array:
    """Logits of final hidden states (tied embeddings or lm_head)."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
