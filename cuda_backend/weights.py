"""GGUF tensors to torch: dequantized once, streamed layer by layer.

Tensor bytes are read through a short-lived ``np.memmap`` at the offsets the
bounded header reader found, dequantized with ``gguf.quants.dequantize`` a few
megabytes of rows at a time and copied straight into the destination tensor
(on the target device, in the target dtype).  Host memory therefore peaks at
the loaded model plus one chunk, not at the float32 image of the largest
tensor.

With ``packed=True`` q8_0 and q4_0 matrices stay in their GGUF blocks (see
:mod:`cuda_backend.quant`) and are dequantized when used, so they occupy the
same bytes as in the file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from gguf_tools import GGUFFormatError, TensorInfo
from localinfer.model.spec import ModelSpec

from . import ggml_numerics, quant

CHUNK_VALUES = 1 << 21          # float32 values dequantized at once (8 MiB)
PACKABLE = {T.Q8_0: "q8_0", T.Q4_0: "q4_0"}
# Types whose 32-value blocks are d · q + m: the f16 min m sits at bytes 2..3.
WITH_MINS = {T.Q4_1: 20, T.Q5_1: 24}


@dataclass(frozen=True)
class Packed:
    """A matrix kept as GGUF blocks: uint8 [rows, row_blocks, block bytes]."""

    blocks: torch.Tensor
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * quant.GROUP

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return quant.dequantize(self.blocks, self.kind, dtype)


Weight = torch.Tensor | Packed | ggml_numerics.BlockMatrix


def tensor_nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, (Packed, ggml_numerics.BlockMatrix)) else w.numel() * w.element_size()


def _raw(path: str, info: TensorInfo, file_size: int) -> np.memmap:
    end = info.file_offset + info.n_bytes
    if end > file_size:
        raise GGUFFormatError(
            f"tensor {info.name} ends at byte {end} but the file has {file_size} bytes (truncated download?)",
            field=info.name, offset=info.file_offset, path=path, hint="download the file again")
    return np.memmap(path, dtype=np.uint8, mode="r", offset=info.file_offset, shape=(info.n_bytes,))


def load_tensor(path: str, info: TensorInfo, file_size: int, device: torch.device, dtype: torch.dtype,
                *, packed: bool = False) -> Weight:
    """One tensor in torch order (GGUF shape reversed), dequantized in row chunks."""
    shape = tuple(reversed(info.shape))
    n_rows = info.n_elements // info.shape[0]
    raw = _raw(path, info, file_size)
    try:
        rows = raw.reshape(n_rows, info.n_bytes // n_rows)
        if packed and info.type in PACKABLE and len(shape) == 2:
            kind = PACKABLE[info.type]
            blocks = torch.from_numpy(np.array(rows)).reshape(n_rows, -1, quant.BLOCK_BYTES[kind])
            return Packed(blocks.to(device), kind)
        out = torch.empty(shape, dtype=dtype, device=device)
        flat = out.view(n_rows, info.shape[0])
        step = max(1, CHUNK_VALUES // info.shape[0])
        for r0 in range(0, n_rows, step):
            values = np.require(gguf_dequantize(rows[r0:r0 + step], info.type), np.float32, ["C", "W"])
            flat[r0:r0 + step].copy_(torch.from_numpy(values))
        return out
    finally:
        del raw


def load_mins(path: str, info: TensorInfo, file_size: int, device: torch.device,
              dtype: torch.dtype) -> torch.Tensor:
    """The per-block mins of a q4_1/q5_1 matrix: [rows, row_length / 32]."""
    raw = _raw(path, info, file_size)
    try:
        blocks = raw.reshape(-1, WITH_MINS[info.type])
        mins = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
        return torch.from_numpy(mins.reshape(info.n_elements // info.shape[0], -1)).to(device, dtype)
    finally:
        del raw


def _progress(total: int, quiet: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, disable=quiet, leave=False)


def load_weights(spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, *,
                 packed: bool = False, llamacpp_rounding: bool = False, quiet: bool = False) -> dict[str, Weight]:
    """All tensors of spec's file by GGUF name, streamed: globals first, then one layer at a time.

    Norm vectors stay float32 (as llama.cpp keeps them); everything else is
    ``dtype`` (or packed blocks), biases too: they are added in ``dtype``, so
    no float32 copy outlives the load.  ``llamacpp_rounding`` keeps q8_0/q4_0/q4_1
    matrices as :class:`ggml_numerics.BlockMatrix` (codes and scales, for ggml's own
    integer dot products) and adds ``NAME:mins`` for q5_1 (see :func:`load_mins`).
    A progress bar goes to stderr unless quiet.
    """
    device = torch.device(device)
    by_layer: dict[int, list[TensorInfo]] = {}
    globals_: list[TensorInfo] = []
    for info in spec.tensors:
        if info.name.startswith("blk."):
            by_layer.setdefault(int(info.name.split(".")[1]), []).append(info)
        else:
            globals_.append(info)
    out: dict[str, Weight] = {}

    def take(info: TensorInfo) -> None:
        if llamacpp_rounding and info.type.name in ggml_numerics.EMULATED_TYPES and len(info.shape) == 2:
            raw = _raw(spec.path, info, spec.file_size)
            rows = info.n_elements // info.shape[0]
            out[info.name] = ggml_numerics.BlockMatrix.from_blocks(
                raw, info.type.name, rows, device, ggml_numerics.repacked_by_llamacpp(info.name, info.type.name, rows))
            del raw
            return
        want = torch.float32 if len(info.shape) == 1 and not info.name.endswith(".bias") else dtype
        out[info.name] = load_tensor(spec.path, info, spec.file_size, device, want, packed=packed)
        if llamacpp_rounding and info.type in WITH_MINS and len(info.shape) == 2:
            out[info.name + ":mins"] = load_mins(spec.path, info, spec.file_size, device, dtype)

    with _progress(spec.n_layers + 1, quiet, f"loading {spec.name}") as bar:
        for info in globals_:
            take(info)
        bar.update(1)
        for il in sorted(by_layer):
            for info in by_layer[il]:
                take(info)
            bar.update(1)
    return out


def weights_nbytes(weights: dict[str, Weight]) -> int:
    """Bytes the loaded tensors occupy (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for w in weights.values():
        key = id(w)
        if key not in seen:
            seen.add(key)
            total += tensor_nbytes(w)
    return total
