"""A sequence's state read to host memory and written back: its recurrent part, or its cells whole.

``llama_state_seq_get_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` writes only the part of a
sequence's memory that positions cannot be cut back to: on a hybrid model the recurrent layers' r and s rows
(``llama_memory_hybrid::state_write`` skips the attention cache), on a pure recurrent model its whole state
(``llama_memory_recurrent::state_write`` ignores the flag).  Written back into a sequence
(``llama_state_seq_set_data_ext``, same flag) it replaces that sequence's recurrent state and leaves its attention
cells alone, so a sequence whose attention cells hold positions [0, n) and whose state was saved at n is exactly
the sequence as it was at n: llama-server's context checkpoints rest on the same two calls.

:func:`read_cells` / :func:`write_cells` move a sequence's whole state, its cells' K and V included
(``llama_state_seq_get_data`` / ``llama_state_seq_set_data``, which lays the cells, in their old order, in the
free cells it meets from its head: one run where those are): the executor's parking in host memory, compaction
(compaction.py) and a prompt computed in a context of its own (aside.py) all rest on them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp as _L
import numpy as np

from localinfer.backends.executor import SeqState
from localinfer.backends.llamacpp.kv_state import HEADER, tile_seq_state
from localinfer.errors import LocalinferError
from localinfer.util.hostmem import host_buffer

PARTIAL = _L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def size(ctx, seq: int) -> int:
    """Bytes of ``seq``'s partial state as llama.cpp would write it now."""
    return int(_L.llama_state_seq_get_size_ext(ctx, seq, PARTIAL))


def read(ctx, seq: int) -> np.ndarray | None:
    """``seq``'s partial state (None when llama.cpp writes fewer bytes than it said it would)."""
    n = size(ctx, seq)
    blob = np.empty(n, dtype=np.uint8)
    got = _L.llama_state_seq_get_data_ext(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq, PARTIAL)
    return blob if got == n else None


def write(ctx, seq: int, blob: np.ndarray) -> bool:
    """Replace ``seq``'s partial state by ``blob``; False when llama.cpp refused it (it then holds none)."""
    ptr = blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    return _L.llama_state_seq_set_data_ext(ctx, ptr, blob.size, seq, PARTIAL) == blob.size


def save(ctx, seq: int, n_tokens: int) -> SeqState:
    """``seq``'s partial state, which holds ``n_tokens`` positions, as a SeqState."""
    blob = read(ctx, seq)
    if blob is None:
        raise LocalinferError(f"llama.cpp did not save sequence {seq}'s state")
    return SeqState(n_tokens, blob.size, blob)


def restore(ctx, mem, seq: int, state: SeqState) -> None:
    """``seq`` back to ``state.n_tokens`` positions: the saved state written in, every position from there dropped
    (also any a failed decode left past it).  A state llama.cpp refuses leaves ``seq`` cleared (LocalinferError)."""
    if not write(ctx, seq, state.data):
        _L.llama_memory_seq_rm(mem, seq, -1, -1)
        raise LocalinferError(f"llama.cpp refused a saved state for sequence {seq}",
                              hint="a snapshot belongs to the model and context it was taken from")
    if not _L.llama_memory_seq_rm(mem, seq, state.n_tokens, -1):
        raise LocalinferError(f"llama.cpp cannot drop positions >= {state.n_tokens} of sequence {seq} after "
                              "restoring its state")


def scratch(n: int) -> np.ndarray:
    """A state's buffer freed at once: the allocator's reused memory (host_buffer's fresh pages cost more)."""
    return np.empty(n, dtype=np.uint8)


def read_cells(ctx, seq: int, n: int | None = None, buffer: Callable[[int], np.ndarray] = host_buffer,
               ) -> np.ndarray | None:
    """``seq``'s whole state (``n`` bytes: ``llama_state_seq_get_size`` unless given) in a buffer from
    ``buffer`` (pinned host memory by default); None when llama.cpp writes fewer bytes than it said it would."""
    n = int(_L.llama_state_seq_get_size(ctx, seq)) if n is None else n
    blob = buffer(n)
    got = _L.llama_state_seq_get_data(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, seq)
    return blob if got == n else None


def write_cells(ctx, seq: int, blob: np.ndarray) -> bool:
    """A :func:`read_cells` state into ``seq``, which holds no cells; False when llama.cpp refused it (no run of
    free cells, another model's state): ``seq`` then holds none still."""
    if _L.llama_state_seq_set_data(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), blob.size, seq) \
            == blob.size:
        return True
    _L.llama_memory_seq_rm(_L.llama_get_memory(ctx), seq, -1, -1)
    return False


def write_tiled(ctx, src: int, dst: int, n: int) -> bool:
    """``dst`` (holding no cells) gets ``n`` positions whose K and V repeat ``src``'s cells (:func:`tile_seq_state`);
    False when llama.cpp refused them (no run of ``n`` free cells)."""
    blob = read_cells(ctx, src, buffer=scratch)
    return blob is not None and write_cells(ctx, dst, tile_seq_state(blob, n))


def whole(ctx) -> memoryview:
    """Every sequence's cells as llama.cpp serialises its whole memory (``llama_state_seq_get_data`` of seq -1)."""
    n = int(_L.llama_state_seq_get_size(ctx, -1))
    blob = np.zeros(n, dtype=np.uint8)
    if _L.llama_state_seq_get_data(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, -1) != n or n < HEADER.size:
        raise LocalinferError("llama.cpp did not serialise its KV state", hint="rerun with LOCALINFER_LLAMA_LOG=1")
    return memoryview(blob)
