"""One place that puts a step engine together: block manager (with parking), scheduler and engine over an executor.

Every choice that depends on the executor is read from its ``caps`` here and nowhere else:
the block size (a paging executor's own), the pool (its cells), whether prefix hits may
come from blocks no sequence holds (``restores_cached_prefix``), whether finished
requests' KV can be parked in spare slots (``drops_tail``, or ``snapshots``: cut back to a
saved recurrent state; not for a paged pool, which keeps cached blocks itself), the
host-memory tier past the cells (``parks_in_host``: as many blocks as the parked ids hold
and the host budget's bytes), and the snapshot store of a recurrent or hybrid model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepEngine, StepRecord
from localinfer.serve.parking import Parking
from localinfer.serve.scheduler import Scheduler, SchedulerConfig
from localinfer.serve.snapshots import SnapshotPolicy, Snapshots
from localinfer.util.hostmem import host_cache_budget
from localinfer.serve.step_model import StepModel


def build_step_engine(executor, config: SchedulerConfig, *, step_model: StepModel | None = None,
                      block_tokens: int | None = None, num_blocks: int | None = None, prefix_cache: bool = True,
                      park_slots: int = 0, preload: Iterable[Sequence[int]] = (),
                      record: bool = False, on_step: Callable[[StepRecord], None] | None = None,
                      snapshot_policy: SnapshotPolicy | None = None, snapshot_budget: int | None = None
                      ) -> StepEngine:
    """A step engine over ``executor``.

    ``block_tokens``: the KV block (the executor's own ``block_size`` wins; default 16);
    ``num_blocks``: the pool (default: the executor's cells in blocks);
    ``park_slots``: sequence slots beyond ``config.max_running`` for finished requests' KV (at most what the
    executor has spare; none where it cannot cut a slot's tail or restores prefixes from its own pool);
    ``preload``: prompts whose whole blocks start in the prefix cache (a warm cache, for replays);
    ``snapshot_policy``, ``snapshot_budget`` (bytes): where a recurrent or hybrid model's state is saved and how
    much host memory the saved states may take (default: ``util.hostmem.host_cache_budget``, as parked KV's).
    """
    caps = executor.caps
    p = caps.block_size or block_tokens or DEFAULT_BLOCK_TOKENS
    cells = caps.n_cells // p
    if num_blocks is None:
        num_blocks = cells
    pool_hits = caps.restores_cached_prefix
    park = 0
    if prefix_cache and (caps.drops_tail or caps.snapshots) and not pool_hits:
        park = max(0, min(park_slots, executor.n_slots - config.max_running))
    snaps = None
    if prefix_cache and caps.snapshots:
        snaps = Snapshots(snapshot_policy, snapshot_budget if snapshot_budget is not None else host_cache_budget())
    host = 0
    if park and caps.parks_in_host:
        per_slot = (caps.slot_cells or num_blocks * p) // p
        host = min(park * per_slot, executor.host_cells() // p)
    blocks = BlockManager(num_blocks + host, p, prefix_cache=prefix_cache, pool_hits=pool_hits,
                          max_used=num_blocks if host else None, parking=Parking(park) if park else None,
                          snapshots=snaps)
    for tokens in preload:
        blocks.preload(tokens)
    return StepEngine(executor, Scheduler(config, blocks, step_model), record=record, on_step=on_step)

