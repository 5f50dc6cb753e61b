"""A sequence's recurrent state, read to host memory and written back (llama.cpp's partial sequence state).

``llama_state_seq_get_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` writes only the part of a
sequence's memory that positions cannot be cut back to: on a hybrid model the recurrent layers' r and s rows
(``llama_memory_hybrid::state_write`` skips the attention cache), on a pure recurrent model its whole state
(``llama_memory_recurrent::state_write`` ignores the flag).  Written back into a sequence
(``llama_state_seq_set_data_ext``, same flag) it replaces that sequence's recurrent state and leaves its attention
cells alone, so a sequence whose attention cells hold positions [0, n) and whose state was saved at n is exactly
the sequence as it was at n: llama-server's context checkpoints rest on the same two calls.
"""

from __future__ import annotations

import ctypes

import llama_cpp as _L
import numpy as np

from localinfer.backends.executor import SeqState
from localinfer.backends.llamacpp.kv_state import HEADER
from localinfer.errors import LocalinferError

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


def whole(ctx) -> memoryview:
    """Every sequence's cells as llama.cpp serialises its whole memory (``llama_state_seq_get_data`` of seq -1)."""
    n = int(_L.llama_state_seq_get_size(ctx, -1))
    blob = np.zeros(n, dtype=np.uint8)
    if _L.llama_state_seq_get_data(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, -1) != n or n < HEADER.size:
        raise LocalinferError("llama.cpp did not serialise its KV state", hint="rerun with LOCALINFER_LLAMA_LOG=1")
    return memoryview(blob)
