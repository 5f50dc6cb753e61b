"""llama.cpp's sequence-state serialisation (``llama_state_seq_get_data``), read and cut without llama.cpp.

    u32 io_magic 0xaf143cd8 | i32 seq_id | u32 n_stream
    | per stream: u32 cell_count | cell_count x (i32 pos, u32 n_seq, [ext], n_seq x i32 seq_id)
                  | u32 v_trans | u32 n_layer | K rows per layer | V rows per layer

:func:`parse_kv_state` lists every cell of a whole-context state (the executor's ``cells()``);
:func:`cut_seq_state` keeps a one-sequence state's cells at some positions (a parked slot's write-back);
:func:`tile_seq_state` repeats them to more positions (a wide KV view to time a step on, nothing computed).
"""

from __future__ import annotations

import struct

import numpy as np

from localinfer.errors import UnsupportedModelError

IO_MAGIC = 0xAF143CD8           # llama_context's state_seq_write_data header
CELL_EXT_BYTES = 12             # llama_kv_cell_ext: i32 x, i32 y, i32 tok (llama-kv-cells.h)
HEADER = struct.Struct("<IiI")  # magic, seq_id, n_stream


def parse_kv_state(blob, n_seq_max: int, ext_bytes: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """(position, sequence ids) of every cell in a ``llama_state_seq_get_data(ctx, .., -1)`` blob.

    ``ext_bytes``: the per-cell extra position llama.cpp writes for M-RoPE models (CELL_EXT_BYTES), else 0.
    """
    magic, _seq, n_stream = HEADER.unpack_from(blob)
    if magic != IO_MAGIC or not 0 < n_stream <= max(n_seq_max, 1):
        raise UnsupportedModelError(f"llama.cpp's KV state has an unexpected header (magic {magic:#x}, "
                                    f"{n_stream} streams)", hint="this llama-cpp-python may be too new or old")
    out, off = [], HEADER.size
    for _ in range(n_stream):
        (count,), off = struct.unpack_from("<I", blob, off), off + 4
        for _ in range(count):
            pos, n_seq = struct.unpack_from("<iI", blob, off)
            off += 8 + ext_bytes
            if not 0 < n_seq <= n_seq_max:
                raise UnsupportedModelError(f"llama.cpp's KV state lists a cell with {n_seq} sequences",
                                            hint="this llama-cpp-python may be too new or old")
            out.append((pos, struct.unpack_from(f"<{n_seq}i", blob, off)))
            off += 4 * n_seq
        if count:
            off = _skip_rows(blob, off, count)
    return out


def cut_seq_state(blob: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """A one-sequence ``llama_state_seq_get_data`` blob keeping only the cells at positions [lo, hi), and how
    many cells it keeps (:func:`_reselect`'s layout, a stream that keeps none its count alone)."""
    def keep(meta):
        pos = meta[:, :4].view("<i4")[:, 0]
        idx = np.flatnonzero((pos >= lo) & (pos < hi))
        return idx, meta[idx]
    return _reselect(blob, keep)


def tile_seq_state(blob: np.ndarray, n: int) -> np.ndarray:
    """A one-sequence state (:func:`cut_seq_state`'s layout) of ``n`` cells at positions 0..n-1, cell i's K and V
    rows those of the state's cell i mod its count: KV no prompt computed, for timing a step over a wide view."""
    magic, _seq, n_stream = HEADER.unpack_from(memoryview(blob))
    if magic == IO_MAGIC and n_stream != 1:
        raise UnsupportedModelError(f"llama.cpp's sequence state has {n_stream} streams",
                                    hint="this llama-cpp-python may be too new or old")

    def repeat(meta):
        idx = np.arange(n) % len(meta)
        out = meta[idx].copy()
        out[:, :4] = np.arange(n, dtype="<i4").view(np.uint8).reshape(n, 4)
        return idx, out
    tiled, kept = _reselect(blob, repeat)
    if not kept:
        raise ValueError("an empty sequence state has no cells to repeat")
    return tiled


def _reselect(blob: np.ndarray, choose) -> tuple[np.ndarray, int]:
    """A one-sequence state rebuilt from some of its cells, and how many it holds: ``choose(meta)`` gives each
    non-empty stream's (indices of the cells taken, their metadata rows) from its cells' metadata.

    Each stream: u32 count, count x (i32 pos, u32 n_seq = 1, i32 seq_id; no model with a per-cell extension
    parks in host memory), then the rows of :func:`_row_blocks`' layout, taken at the chosen indices; a stream
    that takes none is its count alone (as llama.cpp writes an empty stream).
    """
    view = memoryview(blob)
    magic, _seq, n_stream = HEADER.unpack_from(view)
    if magic != IO_MAGIC:
        raise UnsupportedModelError(f"llama.cpp's sequence state has magic {magic:#x}",
                                    hint="this llama-cpp-python may be too new or old")
    parts, off, kept = [blob[:HEADER.size]], HEADER.size, 0
    rec = 12
    for _ in range(n_stream):
        (count,), off = struct.unpack_from("<I", view, off), off + 4
        if not count:
            parts.append(np.zeros(4, np.uint8))
            continue
        meta = blob[off:off + count * rec].reshape(count, rec)
        if np.any(meta[:, 4:8].view("<u4") != 1):
            raise UnsupportedModelError("a sequence's KV state lists a cell of several sequences",
                                        hint="this llama-cpp-python may be too new or old")
        idx, taken = choose(meta)
        n = len(idx)
        off += count * rec
        stream = [np.frombuffer(struct.pack("<I", n), np.uint8), taken.ravel(), blob[off:off + 8]]
        blocks, off = _row_blocks(view, off, count)
        for head, start, shape in blocks:
            rows = blob[start:start + int(np.prod(shape))].reshape(shape)
            stream += [blob[head:start], (rows[idx] if len(shape) == 2 else rows[:, idx]).ravel()]
        parts += stream if n else stream[:1]
        kept += n
    if off != blob.size:
        raise UnsupportedModelError(f"llama.cpp's sequence state has {blob.size - off} unread bytes",
                                    hint="this llama-cpp-python may be too new or old")
    return np.concatenate(parts), kept


def _skip_rows(blob, off: int, count: int) -> int:
    """Past one stream's K and V rows (:func:`_row_blocks`)."""
    return _row_blocks(blob, off, count)[1]


def _row_blocks(blob, off: int, count: int) -> tuple[list[tuple[int, int, tuple[int, ...]]], int]:
    """One stream's K and V rows after its cells' metadata: each block's (header offset, rows offset, shape) and
    the offset past them.  u32 v_trans, u32 n_layer, then per layer (i32 type, u64 row bytes, rows: shape
    (count, row bytes)) for K, the same for V, or for a transposed V (i32 type, u32 element bytes, u32 row width,
    elements: shape (width, count, element bytes))."""
    v_trans, n_layer = struct.unpack_from("<II", blob, off)
    off += 8
    blocks = []
    for half in range(2):
        for _ in range(n_layer):
            if half and v_trans:
                _t, el, width = struct.unpack_from("<iII", blob, off)
                shape = (width, count, el)
            else:
                _t, row = struct.unpack_from("<iQ", blob, off)
                shape = (count, row)
            blocks.append((off, off + 12, shape))
            off += 12 + int(np.prod(shape))
    return blocks, off


def layout_known(blob: np.ndarray, n_tokens: int) -> bool:
    """Whether :func:`cut_seq_state` knows this one-sequence state's layout (a layer without V, say, it does not):
    the state of ``n_tokens`` positions must survive its own whole cut unchanged."""
    try:
        return bool(np.array_equal(cut_seq_state(blob, 0, n_tokens)[0], blob))
    except (UnsupportedModelError, struct.error, ValueError):
        return False
