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
