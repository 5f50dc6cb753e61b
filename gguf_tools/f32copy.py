"""An F32 copy of a GGUF: the same metadata, every tensor dequantized to F32.

llama.cpp multiplies F32 weights with F32 activations, so a copy like this
takes its 8-bit activation rounding out of a comparison with another engine
(see localinfer/mlx_backend/reference.py and benchmarks/batch_invariance.py).
Imports numpy and gguf, so ``import gguf_tools`` does not import it.
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
