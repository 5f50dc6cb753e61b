"""Model presets for skeleton GGUFs: the architecture facts of models people run.

Each preset is a plain dict in the same schema a ``--spec`` file uses (see
``gguf_tools.skeleton.SPEC_FIELDS``).  Numbers come from each model's published
``config.json``; ``type`` is the default file type and ``types`` the ones the
preset is meant for (any ftype in ``gguf_tools.mix.FTYPES`` works).
"""

from __future__ import annotations

from typing import Any

_QWEN3_8B: dict[str, Any] = {
    "arch": "qwen3", "name": "Qwen3-8B",
    "n_layers": 36, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128,
    "n_ff": 12288, "vocab_size": 151936, "context_length": 40960,
    "rope_freq_base": 1_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "type": "bf16", "types": ["bf16", "q8_0", "q4_0", "q2_k"],
    "source": "Qwen/Qwen3-8B config.json",
}

_QWEN3_235B: dict[str, Any] = {
    "arch": "qwen3moe", "name": "Qwen3-235B-A22B",
    "n_layers": 94, "n_embd": 4096, "n_head": 64, "n_head_kv": 4, "head_dim": 128,
    "n_ff": 12288, "n_expert": 128, "n_expert_used": 8, "expert_ff": 1536,
    "vocab_size": 151936, "context_length": 40960,
    "rope_freq_base": 1_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "type": "q2_k", "types": ["q2_k", "q4_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3-235B-A22B config.json",
}

# Unsloth's UD-Q2_K_XL is a hand-tuned mix whose per-tensor table is not published as
# text; this approximates it: llama.cpp's Q2_K mix with the embedding and attention raised
# to Q4_K (V to Q6_K) and the expert FFNs of the first layers raised one step, with the
# number of raised layers chosen so the file comes to the published ≈81.97 GiB.
_QWEN3_235B_UD = {
    **_QWEN3_235B,
    "name": "Qwen3-235B-A22B (UD-Q2_K_XL approximation)",
    "type": "q2_k", "types": ["q2_k"],
    "overrides": [
        [r"^token_embd\.weight$", "q4_k"],
        [r"\.attn_(q|k|output)\.weight$", "q4_k"],
        [r"\.attn_v\.weight$", "q6_k"],
        [r"^blk\.[0-4]\.ffn_(gate|up)_exps\.weight$", "q3_k"],
        [r"^blk\.0\.ffn_down_exps\.weight$", "q4_k"],
    ],
    "source": "Qwen/Qwen3-235B-A22B config.json; mix approximated (unsloth UD-Q2_K_XL ≈ 81.97 GiB)",
}

_LLAMA31_8B: dict[str, Any] = {
    "arch": "llama", "name": "Llama-3.1-8B",
    "n_layers": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128,
    "n_ff": 14336, "vocab_size": 128256, "context_length": 131072,
    "rope_freq_base": 500_000.0, "norm_eps": 1e-5, "tied_embeddings": False, "rope_freqs": True,
    "type": "bf16", "types": ["bf16", "q8_0", "q4_0", "q4_k_m"],
    "source": "meta-llama/Llama-3.1-8B config.json (llama3 rope scaling -> rope_freqs tensor)",
}

_SMOLLM2_135M: dict[str, Any] = {
    "arch": "llama", "name": "SmolLM2-135M",
    "n_layers": 30, "n_embd": 576, "n_head": 9, "n_head_kv": 3, "head_dim": 64,
    "n_ff": 1536, "vocab_size": 49152, "context_length": 8192,
    "rope_freq_base": 100_000.0, "norm_eps": 1e-5, "tied_embeddings": True,
    "type": "q4_1", "types": ["q4_1", "q8_0", "bf16"],
    "source": "HuggingFaceTB/SmolLM2-135M config.json (the embedded default model is its Q4_1)",
}

# ---- hybrid recurrent + attention presets (gguf_tools/layouts/hybrid.py) -----------------------------------
# Qwen3.5 / Qwen3-Next: SSM fields in llama.cpp's meaning (conversion/qwen.py): ssm_state = linear_key_head_dim,
# ssm_groups = linear_num_key_heads, ssm_dt_rank = linear_num_value_heads; every 4th layer is full attention.

_QWEN35_9B: dict[str, Any] = {
    "arch": "qwen35", "name": "Qwen3.5-9B",
    "n_layers": 32, "n_embd": 4096, "n_head": 16, "n_head_kv": 4, "head_dim": 256,
    "n_ff": 12288, "vocab_size": 248320, "context_length": 262144,
    "rope_freq_base": 10_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "full_attention_interval": 4, "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_dt_rank": 32,
    "rope_sections": [11, 11, 10, 0],
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3.5-9B config.json (text_config); no MTP block (convert --no-mtp)",
}

_QWEN35_27B: dict[str, Any] = {
    **_QWEN35_9B, "name": "Qwen3.5-27B",
    "n_layers": 64, "n_embd": 5120, "n_head": 24, "n_head_kv": 4, "head_dim": 256, "n_ff": 17408,
    "ssm_groups": 16, "ssm_dt_rank": 48,
    "source": "Qwen/Qwen3.5-27B config.json (text_config); no MTP block (convert --no-mtp)",
}

_QWEN35_35B_A3B: dict[str, Any] = {
    "arch": "qwen35moe", "name": "Qwen3.5-35B-A3B",
    "n_layers": 40, "n_embd": 2048, "n_head": 16, "n_head_kv": 2, "head_dim": 256,
    "n_expert": 256, "n_expert_used": 8, "expert_ff": 512, "shared_expert_ff": 512,
    "vocab_size": 248320, "context_length": 262144,
    "rope_freq_base": 10_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "full_attention_interval": 4, "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_dt_rank": 32,
    "rope_sections": [11, 11, 10, 0],
    "type": "q4_k_m", "types": ["q4_k_m", "q3_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3.5-35B-A3B config.json (text_config); no MTP block (convert --no-mtp)",
}

_QWEN3_NEXT_80B: dict[str, Any] = {
    "arch": "qwen3next", "name": "Qwen3-Next-80B-A3B",
    "n_layers": 48, "n_embd": 2048, "n_head": 16, "n_head_kv": 2, "head_dim": 256, "n_ff": 5120,
    "n_expert": 512, "n_expert_used": 10, "expert_ff": 512, "shared_expert_ff": 512,
    "vocab_size": 151936, "context_length": 262144,
    "rope_freq_base": 10_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "full_attention_interval": 4, "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_dt_rank": 32,
    "type": "q4_k_m", "types": ["q4_k_m", "q2_k", "q8_0", "bf16"],
    "source": "Qwen/Qwen3-Next-80B-A3B-Instruct config.json; no MTP block (convert --no-mtp)",
}

# Granite 4.0-H: attention at layers 5, 15, 25, 35 (layer_types), the rest Mamba-2 (d_head 64); no RoPE, so the
# converter writes context_length 2**20 (conversion/granite.py).
_GRANITE4_PATTERN = "".join("*" if i % 10 == 5 else "M" for i in range(40))

_GRANITE4_H_SMALL: dict[str, Any] = {
    "arch": "granitehybrid", "name": "Granite-4.0-H-Small",
    "n_layers": 40, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128,
    "n_expert": 72, "n_expert_used": 10, "expert_ff": 768, "shared_expert_ff": 1536,
    "vocab_size": 100352, "context_length": 1 << 20, "norm_eps": 1e-5, "tied_embeddings": True,
    "layer_pattern": _GRANITE4_PATTERN,
    "ssm_conv_kernel": 4, "ssm_inner": 8192, "ssm_state": 128, "ssm_groups": 1, "ssm_dt_rank": 128,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "ibm-granite/granite-4.0-h-small config.json (mamba_n_heads 128, mamba_d_head 64, mamba_n_groups 1)",
}

_GRANITE4_H_TINY: dict[str, Any] = {
    **_GRANITE4_H_SMALL, "name": "Granite-4.0-H-Tiny",
    "n_embd": 1536, "n_head": 12, "n_head_kv": 4, "head_dim": 128,
    "n_expert": 64, "n_expert_used": 6, "expert_ff": 512, "shared_expert_ff": 1024,
    "ssm_inner": 3072, "ssm_dt_rank": 48,
    "source": "ibm-granite/granite-4.0-h-tiny config.json (mamba_n_heads 48, mamba_d_head 64, mamba_n_groups 1)",
}

# Nemotron-H: M Mamba-2, * attention, - squared-ReLU MLP (hybrid_override_pattern); Mamba heads 128 x 80.
_NEMOTRON_NANO_9B_V2: dict[str, Any] = {
    "arch": "nemotron_h", "name": "NVIDIA-Nemotron-Nano-9B-v2",
    "n_layers": 56, "n_embd": 4480, "n_head": 40, "n_head_kv": 8, "head_dim": 128, "n_ff": 15680,
    "vocab_size": 131072, "context_length": 131072, "norm_eps": 1e-5, "tied_embeddings": False,
    "layer_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "ssm_conv_kernel": 4, "ssm_inner": 10240, "ssm_state": 128, "ssm_groups": 8, "ssm_dt_rank": 128,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json",
}

# LFM2: short-conv layers (conv_L_cache 3) and attention at full_attn_idxs; FFN 12288 auto-adjusted to 8192.
_LFM2_1_2B: dict[str, Any] = {
    "arch": "lfm2", "name": "LFM2-1.2B",
    "n_layers": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 8, "head_dim": 64, "n_ff": 8192,
    "vocab_size": 65536, "context_length": 128000, "rope_freq_base": 1_000_000.0, "norm_eps": 1e-5,
    "tied_embeddings": True,
    "layer_pattern": "".join("*" if i in (2, 5, 8, 10, 12, 14) else "M" for i in range(16)),
    "ssm_conv_kernel": 3,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "LiquidAI/LFM2-1.2B config.json",
}

# Pure Mamba-2 (mamba_ssm defaults: d_state 128, head dim 64, n_groups 1, d_conv 4, expand 2); the converter pads
# the vocabulary to a multiple of 16 (conversion/mamba.py) and writes head_count 0, so n_head here is a placeholder.
_MAMBA2_2_7B: dict[str, Any] = {
    "arch": "mamba2", "name": "mamba2-2.7b",
    "n_layers": 64, "n_embd": 2560, "n_head": 1, "vocab_size": 50288, "context_length": 1 << 20,
    "norm_eps": 1e-5, "tied_embeddings": True,
    "ssm_conv_kernel": 4, "ssm_inner": 5120, "ssm_state": 128, "ssm_groups": 1, "ssm_dt_rank": 80,
    "type": "q8_0", "types": ["q8_0", "q4_k_m", "bf16"],
    "source": "state-spaces/mamba2-2.7b config.json (d_model 2560, n_layer 64, vocab 50277 padded to 50288)",
}

HYBRID_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": _QWEN35_9B,
    "qwen3.5-27b": _QWEN35_27B,
    "qwen3.5-35b-a3b": _QWEN35_35B_A3B,
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
    "granite-4.0-h-small": _GRANITE4_H_SMALL,
    "granite-4.0-h-tiny": _GRANITE4_H_TINY,
    "nemotron-nano-9b-v2": _NEMOTRON_NANO_9B_V2,
    "lfm2-1.2b": _LFM2_1_2B,
    "mamba2-2.7b": _MAMBA2_2_7B,
}
# ---- end of hybrid presets ------------------------------------------------------------------------------------

# ---- MLA and attention-family architectures (arch-mla branch) ---------------------------------------------

_DEEPSEEK_V3: dict[str, Any] = {
    "arch": "deepseek2", "name": "DeepSeek-V3",
    "n_layers": 61, "n_embd": 7168, "n_head": 128, "n_ff": 18432, "vocab_size": 129280, "context_length": 163840,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_expert": 256, "n_expert_used": 8, "expert_ff": 2048, "n_expert_shared": 1, "n_dense_lead": 3,
    "expert_gating": "sigmoid", "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_probs_bias": True,
    "n_expert_groups": 8, "n_group_used": 4,
    "rope_freq_base": 10000.0, "rope_scaling": "yarn", "rope_scaling_factor": 40.0, "rope_scaling_orig_ctx": 4096,
    "rope_yarn_log_mul": 1.0, "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0,
    "norm_eps": 1e-6, "tied_embeddings": False,
    "type": "q4_k_m", "types": ["q2_k", "q4_k_m", "q8_0", "bf16"],
    "source": "deepseek-ai/DeepSeek-V3 config.json (the MTP block, num_nextn_predict_layers = 1, is dropped by the "
              "converter: DeepseekV2Model.skip_mtp)",
}
# bartowski's DeepSeek-V3-0324-Q4_K_M.gguf is 404.43 GB (https://huggingface.co/bartowski/deepseek-ai_DeepSeek-V3-0324-GGUF,
# llama.cpp b4944: the legacy attn_kv_b layout, imatrix); this preset at q4_k_m: 404.55 GB with mla_legacy,
# 404.49 GB in the split MLA layout (tensor bytes; the real header adds ≈ 10 MB of tokenizer).

_KIMI_K2: dict[str, Any] = {
    **_DEEPSEEK_V3, "name": "Kimi-K2-Instruct",
    "n_head": 64, "vocab_size": 163840, "context_length": 131072,
    "n_expert": 384, "n_dense_lead": 1, "expert_weights_scale": 2.827, "n_expert_groups": 1, "n_group_used": 1,
    "rope_freq_base": 50000.0, "rope_scaling_factor": 32.0, "rope_yarn_beta_fast": 1.0,
    "type": "q4_k_m", "types": ["q2_k", "q4_k_m", "q8_0"],
    "source": "moonshotai/Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM; llama.cpp arch deepseek2)",
}

_DEEPSEEK_V2_LITE: dict[str, Any] = {
    **_DEEPSEEK_V3, "name": "DeepSeek-V2-Lite",
    "n_layers": 27, "n_embd": 2048, "n_head": 16, "n_ff": 10944, "vocab_size": 102400,
    "q_lora_rank": 0, "n_expert": 64, "n_expert_used": 6, "expert_ff": 1408, "n_expert_shared": 2, "n_dense_lead": 1,
    "expert_gating": "softmax", "expert_weights_scale": 1.0, "expert_weights_norm": False, "expert_probs_bias": False,
    "n_expert_groups": 1, "n_group_used": 1, "rope_yarn_log_mul": 0.707,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "deepseek-ai/DeepSeek-V2-Lite config.json (q_lora_rank null: a plain attn_q; the loader takes "
              "27 blocks for \"lite\" and reads no q_lora_rank)",
}
# mradermacher's static DeepSeek-V2-Lite quants (https://huggingface.co/mradermacher/DeepSeek-V2-Lite-GGUF): Q2_K 6.43,
# Q3_K_M 8.13, Q4_K_S 9.53, Q4_K_M 10.4, Q5_K_M 11.9, Q6_K 14.1, Q8_0 16.7 GB; this preset (+ ≈ 5 MB of header):
# 6.44, 8.13, 9.54, 10.37, 11.85, 14.08, 16.70 GB, each within the 3-digit rounding but Q2_K's (+0.1 %).

_QWEN3_30B_A3B: dict[str, Any] = {
    "arch": "qwen3moe", "name": "Qwen3-30B-A3B",
    "n_layers": 48, "n_embd": 2048, "n_head": 32, "n_head_kv": 4, "head_dim": 128,
    "n_ff": 6144, "n_expert": 128, "n_expert_used": 8, "expert_ff": 768,
    "vocab_size": 151936, "context_length": 40960,
    "rope_freq_base": 1_000_000.0, "norm_eps": 1e-6, "tied_embeddings": False,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "Qwen/Qwen3-30B-A3B config.json",
}
# a Q4_K_M of the same shape (Qwen3-Coder-30B-A3B) is 18.6 GB
# (https://huggingface.co/prithivMLmods/Qwen3-Coder-30B-A3B-Instruct-GGUF/blob/main/qwen3-coder-30b-a3b-instruct-q4_k_m.gguf);
# this preset at q4_k_m: 18.55 GB.

# OpenAI ships the expert stacks in MXFP4 and the rest in BF16; convert_hf_to_gguf copies the MXFP4 blocks as they
# are (conversion/gpt_oss.py repack_mxfp4), so the default "bf16" file is the checkpoint as shipped.  "mxfp4_moe" is
# llama-quantize's MXFP4_MOE (experts MXFP4, the rest Q8_0), the mix of ggml-org's gpt-oss-*-mxfp4.gguf.
_GPT_OSS_20B: dict[str, Any] = {
    "arch": "gpt-oss", "name": "gpt-oss-20b",
    "n_layers": 24, "n_embd": 2880, "n_head": 64, "n_head_kv": 8, "head_dim": 64,
    "n_ff": 2880, "n_expert": 32, "n_expert_used": 4, "expert_ff": 2880,
    "vocab_size": 201088, "context_length": 131072, "sliding_window": 128,
    "rope_freq_base": 150000.0, "rope_scaling": "yarn", "rope_scaling_factor": 32.0, "rope_scaling_orig_ctx": 4096,
    "rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0, "norm_eps": 1e-5, "tied_embeddings": False,
    "overrides": [[r"_exps\.weight$", "mxfp4"]],
    "type": "bf16", "types": ["bf16", "mxfp4_moe"],
    "source": "openai/gpt-oss-20b config.json (experts MXFP4 as shipped)",
}
# unsloth's gpt-oss-20b-F16.gguf (MXFP4 experts + F16) is 13.8 GB (https://huggingface.co/unsloth/gpt-oss-20b-GGUF);
# this preset: 13.77 GB at bf16 (+ ≈ 4 MB of tokenizer header).  An MXFP4_MOE file of the same shape is 12.1 GB
# (https://huggingface.co/benhaotang/gpt-oss-coder-20B-GGUF/blob/main/gpt-oss-coder-MXFP4_MOE.gguf); this preset: 12.10 GB.

_GPT_OSS_120B: dict[str, Any] = {
    **_GPT_OSS_20B, "name": "gpt-oss-120b", "n_layers": 36, "n_expert": 128,
    "source": "openai/gpt-oss-120b config.json (experts MXFP4 as shipped)",
}
# OpenAI's model card gives 60.8 GiB for the MXFP4 + BF16 checkpoint; this preset at bf16: 60.84 GiB (its biases
# are F32, as the converter writes them).

_GLM45_AIR: dict[str, Any] = {
    "arch": "glm4moe", "name": "GLM-4.5-Air",
    "n_layers": 46, "n_embd": 4096, "n_head": 96, "n_head_kv": 8, "head_dim": 128,
    "n_ff": 10944, "n_expert": 128, "n_expert_used": 8, "expert_ff": 1408, "n_expert_shared": 1, "n_dense_lead": 1,
    "expert_gating": "sigmoid", "expert_weights_scale": 1.0, "expert_weights_norm": True,
    "n_expert_groups": 1, "n_group_used": 1, "nextn_layers": 1, "rope_dim": 64,
    "vocab_size": 151552, "context_length": 131072,
    "rope_freq_base": 1_000_000.0, "norm_eps": 1e-5, "tied_embeddings": False,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "zai-org/GLM-4.5-Air config.json (partial_rotary_factor 0.5; the converter appends the NextN block)",
}
# ubergarm's GLM-4.5-Air Q8_0 is 109.381 GiB and BF16 205.811 GiB (https://huggingface.co/ubergarm/GLM-4.5-Air-GGUF;
# 803 tensors, as a GLM-4.5-Air GGUF's loader log lists); this preset: 109.38 GiB at q8_0, 205.77 GiB at bf16
# (norms and router in BF16 here, F32 there).

_LLAMA4_SCOUT: dict[str, Any] = {
    "arch": "llama4", "name": "Llama-4-Scout-17B-16E",
    "n_layers": 48, "n_embd": 5120, "n_head": 40, "n_head_kv": 8, "head_dim": 128,
    "n_ff": 16384, "n_expert": 16, "n_expert_used": 1, "expert_ff": 8192, "moe_every": 1,
    "vocab_size": 202048, "context_length": 10485760,
    "rope_freq_base": 500_000.0, "norm_eps": 1e-5, "tied_embeddings": False, "rope_freqs": True,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "meta-llama/Llama-4-Scout-17B-16E config.json text_config (intermediate_size_mlp -> n_ff, "
              "intermediate_size -> expert_ff; llama3 rope scaling -> rope_freqs tensor)",
}

_GEMMA3_27B: dict[str, Any] = {
    "arch": "gemma3", "name": "Gemma-3-27B",
    "n_layers": 62, "n_embd": 5376, "n_head": 32, "n_head_kv": 16, "head_dim": 128,
    "n_ff": 21504, "vocab_size": 262144, "context_length": 131072, "sliding_window": 1024,
    "rope_freq_base": 1_000_000.0, "rope_freq_base_swa": 10000.0, "rope_scaling": "linear", "rope_scaling_factor": 8.0,
    "norm_eps": 1e-6, "tied_embeddings": True,
    "type": "q4_k_m", "types": ["q4_k_m", "q8_0", "bf16"],
    "source": "google/gemma-3-27b-it config.json text_config (vocab 262208 trimmed to the tokenizer's 262144 by "
              "conversion/gemma.py)",
}
# mradermacher's static gemma-3-27b-it quants (https://huggingface.co/mradermacher/gemma-3-27b-it-GGUF): Q2_K 10.5,
# Q3_K_M 13.4, Q4_K_S 15.7, Q4_K_M 16.5, Q5_K_M 19.3, Q6_K 22.2, Q8_0 28.7 GB; this preset (+ ≈ 6 MB of header):
# 10.50, 13.44, 15.67, 16.55, 19.27, 22.17, 28.71 GB, each within the 3-digit rounding.

MLA_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-r1": {**_DEEPSEEK_V3, "name": "DeepSeek-R1", "source": "deepseek-ai/DeepSeek-R1 config.json (DeepSeek-V3's shape)"},
    "kimi-k2": _KIMI_K2,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-120b": _GPT_OSS_120B,
    "glm-4.5-air": _GLM45_AIR,
    "llama-4-scout-17b-16e": _LLAMA4_SCOUT,
    "gemma-3-27b": _GEMMA3_27B,
}
# ---- end of the arch-mla block ---------------------------------------------------------------------------------


# ---- dense decoders people run (and that published llama-bench tables use: benchmarks/speed_published.py) ----
def _dense(arch: str, name: str, n_layers: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, vocab: int,
           tied: bool, rope: float, source: str, head_dim: int | None = None, eps: float = 1e-5, ctx: int = 32768,
           **extra: Any) -> dict[str, Any]:
    return {"arch": arch, "name": name, "n_layers": n_layers, "n_embd": n_embd, "n_head": n_head,
            "n_head_kv": n_head_kv, "head_dim": head_dim or n_embd // n_head, "n_ff": n_ff, "vocab_size": vocab,
            "context_length": ctx, "rope_freq_base": rope, "norm_eps": eps, "tied_embeddings": tied,
            "type": "q4_k_m", "types": ["q4_0", "q4_k_m", "q8_0", "f16"], "source": source, **extra}


DENSE_PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _dense("llama", "Llama-2-7B", 32, 4096, 32, 32, 11008, 32000, False, 10000.0,
                         "meta-llama/Llama-2-7b-hf config.json (llama-bench's \"llama 7B\": 6.74 B params)", ctx=4096),
    "llama-3.2-1b": _dense("llama", "Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, True, 500000.0,
                           "meta-llama/Llama-3.2-1B config.json", head_dim=64, ctx=131072, rope_freqs=True),
    "llama-3.2-3b": _dense("llama", "Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, True, 500000.0,
                           "meta-llama/Llama-3.2-3B config.json", head_dim=128, ctx=131072, rope_freqs=True),
    "llama-3.1-70b": _dense("llama", "Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, False, 500000.0,
                            "meta-llama/Llama-3.1-70B config.json", ctx=131072, rope_freqs=True),
    "llama-3.1-405b": _dense("llama", "Llama-3.1-405B", 126, 16384, 128, 8, 53248, 128256, False, 500000.0,
                             "meta-llama/Llama-3.1-405B config.json", ctx=131072, rope_freqs=True),
    "mistral-7b": _dense("llama", "Mistral-7B-v0.1", 32, 4096, 32, 8, 14336, 32000, False, 10000.0,
                         "mistralai/Mistral-7B-v0.1 config.json"),
    "qwen2.5-0.5b": _dense("qwen2", "Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, True, 1000000.0,
                           "Qwen/Qwen2.5-0.5B config.json", eps=1e-6),
    "qwen2.5-1.5b": _dense("qwen2", "Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, True, 1000000.0,
                           "Qwen/Qwen2.5-1.5B config.json", eps=1e-6),
    "qwen2.5-3b": _dense("qwen2", "Qwen2.5-3B", 36, 2048, 16, 2, 11008, 151936, True, 1000000.0,
                         "Qwen/Qwen2.5-3B config.json", eps=1e-6),
    "qwen2.5-7b": _dense("qwen2", "Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, False, 1000000.0,
                         "Qwen/Qwen2.5-7B config.json", eps=1e-6),
    "qwen2.5-14b": _dense("qwen2", "Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, False, 1000000.0,
                          "Qwen/Qwen2.5-14B config.json", eps=1e-5),
    "qwen2.5-32b": _dense("qwen2", "Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, False, 1000000.0,
                          "Qwen/Qwen2.5-32B config.json", eps=1e-5),
    "qwen2.5-72b": _dense("qwen2", "Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, False, 1000000.0,
                          "Qwen/Qwen2.5-72B config.json", eps=1e-5),
    "qwen3-0.6b": _dense("qwen3", "Qwen3-0.6B", 28, 1024, 16, 8, 3072, 151936, True, 1000000.0,
                         "Qwen/Qwen3-0.6B config.json", head_dim=128, eps=1e-6, ctx=40960),
    "qwen3-1.7b": _dense("qwen3", "Qwen3-1.7B", 28, 2048, 16, 8, 6144, 151936, True, 1000000.0,
                         "Qwen/Qwen3-1.7B config.json", head_dim=128, eps=1e-6, ctx=40960),
    "qwen3-4b": _dense("qwen3", "Qwen3-4B", 36, 2560, 32, 8, 9728, 151936, True, 1000000.0,
                       "Qwen/Qwen3-4B config.json", head_dim=128, eps=1e-6, ctx=40960),
    "qwen3-14b": _dense("qwen3", "Qwen3-14B", 40, 5120, 40, 8, 17408, 151936, False, 1000000.0,
                        "Qwen/Qwen3-14B config.json", head_dim=128, eps=1e-6, ctx=40960),
    "qwen3-32b": _dense("qwen3", "Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, False, 1000000.0,
                        "Qwen/Qwen3-32B config.json", head_dim=128, eps=1e-6, ctx=40960),
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": _QWEN3_8B,
    "qwen3-235b-a22b": _QWEN3_235B,
    "qwen3-235b-a22b-ud-q2_k_xl": _QWEN3_235B_UD,
    "llama-3.1-8b": _LLAMA31_8B,
    "smollm2-135m": _SMOLLM2_135M,
    # ---- hybrid recurrent + attention (gguf_tools/layouts/hybrid.py) ----
    **HYBRID_PRESETS,
    # ---- MLA and the attention-family architectures (layouts/mla.py, attention.py, interleaved.py) ----
    **MLA_PRESETS,
    **DENSE_PRESETS,
}


def get_preset(name: str) -> dict[str, Any]:
    """A copy of one preset; ValueError naming the known presets."""
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    spec = dict(PRESETS[key])
    spec["preset"] = key
    return spec


def list_presets() -> list[tuple[str, str, str, list[str]]]:
    """(preset, model name, default type, suggested types) for each preset."""
    return [(key, p["name"], p["type"], list(p["types"])) for key, p in PRESETS.items()]
