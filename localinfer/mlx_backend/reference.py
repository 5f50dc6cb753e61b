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

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.quants import dequantize

from gguf_tools import read_header

_WRITER_KEYS = ("general.architecture", "general.alignment")


def write_f32_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write dst: src's metadata and every tensor dequantized to F32 (atomically)."""
    header = read_header(src)
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    writer = GGUFWriter(str(tmp), header.kv["general.architecture"])
    for key, value in header.kv.items():
        if key in _WRITER_KEYS:
            continue
        vtype, sub = header.kv_types[key]
        writer.add_key_value(key, 0 if key == "general.file_type" else value, vtype, sub)
    data = np.memmap(os.fspath(src), dtype=np.uint8, mode="r")
    for t in header.tensors:
        blob = data[t.file_offset: t.file_offset + t.n_bytes]
        rows = t.n_elements // t.shape[0]
        values = dequantize(blob.reshape(rows, -1), t.type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape(tuple(reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst)
    return dst
