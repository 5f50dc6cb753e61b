"""A tiny MoE skeleton (8 layers, 32 experts, 4 used) for the host-split tests (tests/plan)."""

from gguf_tools.skeleton import write_skeleton
from localinfer.model.spec import ModelSpec

TINY_MOE = {"n_layers": 8, "n_embd": 512, "n_head": 8, "n_head_kv": 2, "head_dim": 64, "n_ff": 0, "vocab_size": 1000,
            "context_length": 4096, "arch": "qwen3moe", "expert_ff": 1024, "n_expert": 32, "n_expert_used": 4}


def tiny_moe(folder, qtype: str) -> ModelSpec:
    """The tiny MoE skeleton in ``qtype``, written under ``folder``."""
    return ModelSpec.from_gguf(str(write_skeleton({**TINY_MOE, "type": qtype}, folder / f"moe-{qtype}.gguf")))
