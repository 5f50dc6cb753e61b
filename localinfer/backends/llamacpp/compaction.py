"""Each sequence's KV cells in one run again: compaction of llama.cpp's unified cache on the CPU.

llama.cpp places a ubatch's tokens in the free cells it meets from its moving head (``find_slot``), so once
requests come and go out of step (a closed loop, staggered arrivals) every finished sequence leaves holes — its
prompt's run and one cell in every n of the decode region — that the next prompt and everyone's decode tokens
fill: a sequence's cells end up in 60-160 runs across the cache.  The attended view is no wider for it, but
ggml-cpu's flash attention walks every cell of the view for every row and skips the masked ones one by one
(``ggml_compute_forward_flash_attn_ext_f16_one_chunk``), and over a churned mask the same 8-row decode step costs
12-30% more than over sequences laid out in runs (benchmarks/kv_layout_steps.py; docs/serving.md, "where the
closed loop's time goes").

:func:`compact` writes every live sequence back in one run: each one's whole state read to host memory
(``llama_state_seq_get_data``), all removed, each written back (``llama_state_seq_set_data`` places a sequence's
cells in one contiguous free run, in their old order, so a row's sum runs in the same order and its logits do not
change).  It is safe only where no cell is held by two sequences (a ``seq_cp`` prefix: written back per sequence it
would be held twice) and nothing else holds cells, so the cells removed are exactly the cells written back into an
empty cache.  :class:`CompactPolicy` decides when: cells were freed since the last compaction (holes exist), at least
``COMPACT_AFTER`` steps of several sequences have interleaved their cells since, and its predicted cost — the KV
bytes the live sequences hold, read and written back at the rate the last compaction moved them (before any,
``PRIOR_RATE``) — is at most ``COMPACT_SHARE`` of the decode time since (a bigger model's KV takes longer to move,
and its steps are longer too; a first compaction of gigabytes waits until the steps since have paid for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import llama_cpp as _L
import numpy as np

from localinfer.backends.llamacpp import seq_state
from localinfer.errors import LocalinferError

COMPACT_AFTER = 16      # steps of >= 2 sequences since the last compaction (each adds one run to every sequence)
COMPACT_SHARE = 0.10    # the most of the decode time since the last compaction that one compaction may cost
PRIOR_RATE = 1 << 30    # bytes of state a compaction moves a second before it has measured its own (this 2-core VM
                        # moved SmolLM2's 56 MiB in 50 ms: 1.1 GiB/s; benchmarks/kv_layout_steps.py --loop)


@dataclass
class CompactPolicy:
    """When to compact; what compaction has cost (``count``, ``seconds``, ``bytes``) for /metrics and benchmarks."""

    able: bool                    # one unified stream on the CPU, no sliding window: compaction is safe and pays
    auto: bool = True             # compact by itself when due (off: only an explicit ``compact()``)
    interleaved: int = 0          # steps of >= 2 sequences since the last compaction
    freed: bool = False           # cells freed (a drop to 0, a park) since the last compaction
    decode_since: float = 0.0     # seconds of llama_decode since the last compaction
    rate: float = PRIOR_RATE      # bytes a second the last compaction moved
    count: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def stepped(self, n_seqs: int, seconds: float) -> None:
        self.interleaved += n_seqs >= 2
        self.decode_since += seconds

    def due(self, live_bytes: Callable[[], int], budget: Callable[[], int]) -> bool:
        """Whether to compact now, the live sequences holding ``live_bytes()`` of KV (held in host memory meanwhile:
        no more than ``budget()``, the executor's host-cache budget); the cheap conditions first, on every step."""
        if not (self.able and self.auto and self.freed and self.interleaved >= COMPACT_AFTER):
            return False
        n = live_bytes()
        return n / self.rate <= COMPACT_SHARE * self.decode_since and n <= budget()

    def done(self, seconds: float, moved: int) -> None:
        self.interleaved, self.freed, self.decode_since = 0, False, 0.0
        if seconds > 0 and moved > 0:
            self.rate = moved / seconds
        self.count += 1
        self.seconds += seconds
        self.bytes += moved


class Shares:
    """Which slots a ``seq_cp`` made share cells, pair by pair: a slot is free of it once each partner holds no
    cells (a shared prefix written back per sequence would be held twice, so any pair blocks compaction)."""

    def __init__(self):
        self._with: dict[int, set[int]] = {}

    def add(self, a: int, b: int) -> None:
        self._with.setdefault(a, set()).add(b)
        self._with.setdefault(b, set()).add(a)

    def gone(self, slot: int) -> None:
        """``slot`` holds no cells any more."""
        for p in self._with.pop(slot, ()):
            left = self._with.get(p)
            if left is not None:
                left.discard(slot)
                if not left:
                    del self._with[p]

    def __bool__(self) -> bool:
        return bool(self._with)


def compact(ctx, mem, slots: Iterable[int]) -> tuple[int, float]:
    """Write each of ``slots`` (every sequence holding cells, none sharing one) back in one run of cells, in the
    order given; (bytes moved, seconds).  A LocalinferError or MemoryError while reading leaves every sequence as it
    was; sequences llama.cpp will not take back are a CompactionError naming them (they hold no cells then): by the
    conditions above that cannot happen short of a llama.cpp fault.  One run each holds because llama.cpp leaves no
    free cell below its head in a stream without sliding-window layers, so the head is 0 once all are removed; were
    it not, a sequence would lie in a few runs: slower, never wrong."""
    t0 = time.perf_counter()
    blobs: list[tuple[int, np.ndarray]] = []
    for s in slots:
        blob = seq_state.read_cells(ctx, s, buffer=seq_state.scratch)
        if blob is None:
            raise LocalinferError(f"llama.cpp did not save sequence {s}'s KV for compaction")
        blobs.append((s, blob))
    for s, _ in blobs:
        _L.llama_memory_seq_rm(mem, s, -1, -1)
    lost = []
    for s, blob in blobs:
        if not seq_state.write_cells(ctx, s, blob):
            lost.append(s)
    if lost:
        raise CompactionError(lost)
    return sum(b.size for _, b in blobs), time.perf_counter() - t0


class CompactionError(LocalinferError):
    """llama.cpp did not take some sequences' KV back: they hold no cells now (``slots``)."""

    def __init__(self, slots: list[int]):
        super().__init__(f"llama.cpp did not take back the KV of sequences {slots} after compaction",
                         hint="rerun with LOCALINFER_LLAMA_LOG=1 and report it")
        self.slots = slots
