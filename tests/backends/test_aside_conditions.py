"""fit counts serve's second context for lone prompts (aside_plan.aside_request, from the header) exactly where the
executor makes it (aside.for_executor, from the loaded model): each architecture family's tiny model loaded in
llama.cpp, and glm4moe with and without the rope sections that make llama.cpp give its cells M-RoPE positions."""

import llama_cpp as _L
import pytest
from gguf import GGUFValueType

from localinfer.backends.llamacpp.aside_plan import aside_request, mrope_cells
from localinfer.backends.llamacpp.executor import LlamaCppExecutor
from localinfer.commands._common import plan_request
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_arch
from tests.support.tiny_archs import TINY

_SECTIONS = {"glm4moe.rope.dimension_sections": ([4, 4, 0, 0], GGUFValueType.ARRAY)}
CASES = {
    "qwen3moe": (TINY["qwen3moe"], None),
    "deepseek2-mla-lite": (TINY["deepseek2-mla-lite"], None),
    "glm4moe": (TINY["glm4moe"], None),
    "glm4moe-vl-sections": (TINY["glm4moe"], _SECTIONS),
    "glm4moe-one-section": (TINY["glm4moe"], {"glm4moe.rope.dimension_sections": (4, GGUFValueType.INT32)}),
    "gemma3": (TINY["gemma3"], None),
    "qwen35": (TINY["qwen35"], None),
    "granitehybrid": (TINY["granitehybrid"], None),
    "llama4-chunked": (TINY["llama4"], None),
    "llama4-no-window": (TINY["llama4"], {"llama4.attention.sliding_window": (0, GGUFValueType.UINT32)}),
    "gpt-oss": (TINY["gpt-oss"], None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_counts_the_second_context_where_the_executor_makes_it(tmp_path, case):
    arch, extra = CASES[case]
    path = write_tiny_arch(tmp_path / f"{case}.gguf", arch, extra_kv=extra)
    spec = ModelSpec.from_gguf(str(path))
    with LlamaCppExecutor.open(str(path), n_slots=2, n_ctx=512, threads=1, flash_attn=True, prefill_aside=True) as x:
        made, plan = x.prefill_aside is not None, x.engine.plan
        rope = _L.llama_model_rope_type(x.engine.model_handle)
    asked = plan_request(spec, plan)
    assert (aside_request(spec, asked, "cpu") is not None) == made, (case, made)
    assert mrope_cells(spec) == (rope in (_L.LLAMA_ROPE_TYPE_MROPE, _L.LLAMA_ROPE_TYPE_IMROPE)), (case, rope)
    if case.startswith(("glm4moe", "llama4")):     # one architecture each: only the extra key tells them apart
        assert made == (extra is not None) ^ case.startswith("glm4moe")
    assert spec.rope_sections == {"glm4moe": (), "glm4moe-vl-sections": (4, 4, 0, 0), "qwen35": (2, 1, 1, 0),
                                  "glm4moe-one-section": (4, 4, 4, 4)}.get(case, spec.rope_sections)


def test_unreadable_rope_sections_are_left_out(tmp_path):
    """A value llama.cpp's loader would not take (not 4 of them, negative) reads as no sections, not a refusal: only
    the architectures that read the key refuse such a file."""
    for bad in ([1, 2, 3, 4, 5], [-1, 2], [4, 4]):
        extra = {"qwen3moe.rope.dimension_sections": (bad, GGUFValueType.ARRAY)}
        path = write_tiny_arch(tmp_path / f"q{len(bad)}.gguf", TINY["qwen3moe"], extra_kv=extra)
        assert ModelSpec.from_gguf(str(path)).rope_sections == ()
