"""Reference copies for checking the mlx backend against llama.cpp.

llama.cpp's CPU kernels round activations to 8 bits per 32 values (q8_0 /
q8_1) before every matrix product with Q4_0, Q4_1 or Q8_0 weights; MLX
multiplies full-precision activations.  On SmolLM2-135M Q4_1 that alone moves
llama.cpp's logits by up to about 0.5 from an exact (float64) evaluation of
the same weights, while MLX stays within 0.001 - so on near-ties the two pick
different greedy tokens.  An F32 copy holding exactly the dequantized weights
takes the activation rounding out of llama.cpp (F32 products stay F32) and
leaves only the two implementations to compare.
"""

from gguf_tools.f32copy import write_f32_copy

__all__ = ["write_f32_copy"]
