"""Tiny specs of every architecture family, for ``tests.support.ggufgen.write_tiny_arch``: random-weight models
llama.cpp loads and decodes in a second (the layouts' tests, the fit-exactness tests, the run tests and the compute
graph tests all use these).  Sizes are small but keep every kind of layer: MLA with and without q_lora and in the
legacy layout, NextN blocks, chunked and sliding windows, and in the hybrids both recurrent and attention layers.
"""

from __future__ import annotations

_MLA = {"arch": "deepseek2", "n_embd": 128, "n_head": 4, "n_ff": 256, "n_expert": 4, "n_expert_used": 2,
        "expert_ff": 64, "n_expert_shared": 1, "n_dense_lead": 1, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32, "v_head_dim": 32, "expert_gating": "sigmoid", "expert_weights_norm": True,
        "expert_weights_scale": 2.5, "expert_probs_bias": True}
_MOE_SMALL = {"n_expert": 4, "n_expert_used": 2, "expert_ff": 64}

ATTENTION = {
    "deepseek2-mla-q-lora": {**_MLA, "n_layers": 3, "q_lora_rank": 64, "n_expert_groups": 2, "n_group_used": 1,
                             "rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_scaling_orig_ctx": 128,
                             "rope_yarn_log_mul": 1.0},
    "deepseek2-mla-lite": {**_MLA, "n_layers": 2, "expert_gating": "softmax", "expert_probs_bias": False},
    "deepseek2-legacy-kv-b": {**_MLA, "n_layers": 3, "q_lora_rank": 64, "mla_legacy": True},
    "deepseek2-nextn": {**_MLA, "n_layers": 2, "q_lora_rank": 64, "nextn_layers": 1},
    "glm4moe": {"arch": "glm4moe", "n_layers": 3, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32,
                "n_ff": 256, **_MOE_SMALL, "n_expert_shared": 1, "n_dense_lead": 1, "nextn_layers": 1,
                "expert_gating": "sigmoid", "expert_weights_norm": True, "expert_weights_scale": 1.0,
                "n_expert_groups": 1, "n_group_used": 1},
    "llama4": {"arch": "llama4", "n_layers": 4, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 256, **_MOE_SMALL,
               "n_expert_used": 1, "moe_every": 2, "rope_freqs": True},
    "gpt-oss": {"arch": "gpt-oss", "n_layers": 2, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32,
                "n_ff": 64, **_MOE_SMALL, "sliding_window": 16, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                "rope_scaling_orig_ctx": 64},
    "gemma3": {"arch": "gemma3", "n_layers": 3, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32,
               "n_ff": 256, "sliding_window": 16, "rope_freq_base_swa": 10000.0, "tied_embeddings": True,
               "rope_scaling": "linear", "rope_scaling_factor": 8.0},
    "qwen3moe": {"arch": "qwen3moe", "n_layers": 2, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 256, **_MOE_SMALL},
}

_DELTA = {"n_layers": 4, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 32,
          "ssm_state": 16, "ssm_groups": 2, "ssm_dt_rank": 4}
_MAMBA = {"n_layers": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "ssm_inner": 128, "ssm_state": 16, "ssm_dt_rank": 8}
_MOE = {"n_expert": 4, "n_expert_used": 2, "expert_ff": 64, "shared_expert_ff": 64}

HYBRID = {
    "qwen35": {"arch": "qwen35", "n_ff": 256, "rope_sections": [2, 1, 1, 0], **_DELTA},
    "qwen35moe": {"arch": "qwen35moe", "rope_sections": [2, 1, 1, 0], **_DELTA, **_MOE},
    "qwen3next": {"arch": "qwen3next", **_DELTA, **_MOE},
    "granitehybrid": {"arch": "granitehybrid", "n_ff": 128, "layer_pattern": "MM*M", **_MAMBA},
    "granitehybrid-moe": {"arch": "granitehybrid", "layer_pattern": "M*MM", **_MAMBA, **_MOE, "expert_ff": 32},
    "nemotron_h": {"arch": "nemotron_h", "n_ff": 128, "layer_pattern": "M-*-", **_MAMBA, "ssm_groups": 2},
    "lfm2": {"arch": "lfm2", "n_layers": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128,
             "layer_pattern": "MM*M", "tied_embeddings": True},
    "mamba2": {"arch": "mamba2", **_MAMBA, "ssm_dt_rank": 4, "tied_embeddings": True},
}
HYBRID["qwen35-mtp"] = {**HYBRID["qwen35"], "nextn_layers": 1}
HYBRID["qwen3next-mtp"] = {**HYBRID["qwen3next"], "nextn_layers": 1}

TINY = {**ATTENTION, **HYBRID}
