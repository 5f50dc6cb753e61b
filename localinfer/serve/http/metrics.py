"""Prometheus metrics (prometheus-client, text exposition format 0.0.4) on a registry of the server's own.

Gauges are read at scrape time from the engine thread's last snapshot (one
dict replaced atomically after each step), so a scrape never touches the
engine.  Counters and histograms are updated by the engine thread as requests
finish, and the refusals' counter by the event loop (prometheus-client's metrics are thread-safe); both only
through :meth:`Metrics.finished_request` and :meth:`Metrics.reject`.

A scrape renders the snapshot's ~35 samples; the request counters and histograms (~140 lines, two thirds of
prometheus-client's rendering time) are rendered again only after they changed (:attr:`Metrics.changes`, a new
stamp after every update): 0.20 ms a scrape instead of 0.48 in process.  What a poll still costs the event loop
is mostly uvicorn's and starlette's handling of the request (benchmarks/results/serve_closed_loop_cpu.txt, fifth
session: the cache did not show in the loop's CPU a token at five polls a second).
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
GAUGES = {
    "requests_running": "requests holding a sequence slot",
    "requests_waiting": "requests queued for admission",
    "kv_blocks_used": "KV blocks referenced by requests",
    "kv_blocks_cached": "KV blocks held only by the prefix cache: parked requests' KV (evictable)",
    "kv_sequences_parked": "finished requests whose KV stays (in host memory or cells) for later prefix hits",
    "kv_blocks_total": "KV blocks requests can hold at once (the cells; parked KV in host memory caches beyond)",
    "kv_cells_used": "llama.cpp KV cells holding a token (sampled when the server is idle)",
    "kv_host_tokens": "parked requests' KV tokens kept in host memory, in no cell (sampled when the server is idle)",
    "snapshots": "recurrent-state snapshots kept in host memory for prefix hits (hybrid and recurrent models)",
    "snapshot_bytes": "host memory the recurrent-state snapshots take",
    "prefill_aside_bytes": "the second context lone prompts are computed in (CPU; LOCALINFER_PREFILL_ASIDE=0 turns it "
                           "off): its KV, compute and output buffers as llama.cpp logged them",
}
COUNTERS = {  # cumulative, from the engine thread's snapshot: wall time of steps, and of it inside llama_decode
    "engine_step_seconds": "seconds the engine spent in executor steps",
    "engine_decode_seconds": "seconds of those inside the backend's forward pass (llama_decode)",
    "engine_steps": "executor steps taken",
    "spec_draft_tokens": "prompt-lookup draft tokens verified (serve --lookup)",
    "spec_accepted_tokens": "of those, accepted",
    "admissions": "requests given a sequence slot (a preempted request again when it is readmitted)",
    "preemptions": "requests preempted (KV dropped, recomputed later)",
    "snapshots_taken": "recurrent-state snapshots saved",
    "snapshots_restored": "prefix hits that restored a recurrent-state snapshot",
    "snapshot_recomputed_tokens": "prompt tokens the prefix cache matched past the deepest snapshot (recomputed)",
    "kv_compactions": "compactions of the KV cache: every running sequence's cells written back in one run (CPU)",
    "kv_compaction_seconds": "seconds those compactions took (inside engine_step_seconds, outside llama_decode)",
    "prefill_aside_prompts": "lone prompts beside running sequences computed in the second context and copied in",
    "prefill_aside_fallbacks": "prompts computed there whose copy found too few free cells (then computed in place)",
    "prefill_aside_seconds": "seconds of those prompts and copies (inside engine_decode_seconds)",
    "stream_frames_direct": "streamed token frames the relay thread wrote to the socket itself (not the event loop)",
    "stream_spills": "of its writes, those a slow reader's socket did not take whole (the event loop wrote the rest)",
}


DEVICE_MEMORY = ("device_memory_bytes", "bytes of model weights, KV cache and compute buffer on each device: what "
                 "llama.cpp reported allocating at load (source=reported, its log: within 0.005 MiB) and what "
                 "fit predicted (source=predicted)")


class _Snapshot:
    """Collector of the gauges above from a dict the engine thread replaces, and of the per-device memory rows
    (``devices``: set once, after the model loads)."""

    def __init__(self):
        self.values: dict[str, float] = {k: 0.0 for k in GAUGES}
        self.devices: list[dict] = []

    def collect(self):
        values = self.values
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(f"localinfer_{name}", doc, value=values.get(name, 0.0))
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(f"localinfer_{name}", doc, value=values.get(name, 0.0))
        if self.devices:
            family = GaugeMetricFamily(f"localinfer_{DEVICE_MEMORY[0]}", DEVICE_MEMORY[1],
                                       labels=("device", "kind", "source"))
            for row in self.devices:
                for source in ("reported", "predicted"):
                    for kind, nbytes in (row.get(source) or {}).items():
                        family.add_metric((row["device"], kind, source), nbytes)
            yield family


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)       # everything, in /metrics' order
        self.snapshot = _Snapshot()
        self._live = CollectorRegistry(auto_describe=True)          # the snapshot: changes every step
        self._requests = r = CollectorRegistry(auto_describe=True)  # changes as requests finish or are refused
        for reg in (self.registry, self._live):
            reg.register(self.snapshot)
        self._stamps = itertools.count(1)                           # next() is atomic under the GIL
        self.changes = 0                                            # a new stamp after each update of ``_requests``
        self._rendered: tuple[int, bytes] = (-1, b"")
        c = lambda name, doc, **kw: Counter(f"localinfer_{name}", doc, registry=None, **kw)
        self.prompt_tokens = c("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = c("generation_tokens", "tokens generated")
        self.prefix_hit_tokens = c("prefix_cache_hit_tokens", "prompt tokens found in the prefix cache")
        self.cancelled = c("requests_cancelled", "requests cancelled by their client (disconnect or shutdown)")
        self.finished = c("requests_finished", "requests finished, by reason", labelnames=("reason",))
        self.rejected = c("requests_rejected", "requests answered with an error status", labelnames=("status",))
        h = lambda name, doc: Histogram(f"localinfer_{name}", doc, registry=None, buckets=_LATENCY)
        self.ttft = h("time_to_first_token_seconds", "arrival to first token")
        self.itl = h("inter_token_latency_seconds", "time between consecutive tokens of a request")
        self.e2e = h("e2e_request_latency_seconds", "arrival to finish")
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_hit_tokens, self.cancelled,
                       self.finished, self.rejected, self.ttft, self.itl, self.e2e):
            for reg in (r, self.registry):                              # one list: both registries the same
                reg.register(metric)

    def publish(self, values: dict[str, float]) -> None:
        self.snapshot.values = values

    def set_devices(self, rows: list[dict]) -> None:
        """Per device, its bytes as loaded and as predicted (rows of localinfer.backends.llamacpp.allocated)."""
        self.snapshot.devices = list(rows)

    @property
    def devices(self) -> list[dict]:
        return self.snapshot.devices

    def gauge(self, name: str) -> float:
        return self.snapshot.values.get(name, 0.0)

    def finished_request(self, r, *, cancelled: bool) -> None:
        """Count a finished engine request (called by the engine thread)."""
        try:
            self._count(r, cancelled)
        finally:
            self.changes = next(self._stamps)       # after the updates: the next scrape renders them

    def _count(self, r, cancelled: bool) -> None:
        self.prompt_tokens.inc(len(r.prompt))
        self.generation_tokens.inc(len(r.output))
        self.prefix_hit_tokens.inc(r.cached)
        if cancelled:
            self.cancelled.inc()
        self.finished.labels(r.finish_reason.value if r.finish_reason else "unknown").inc()
        if r.ttft_s is not None:
            self.ttft.observe(max(0.0, r.ttft_s))
        for g in r.gaps_s:
            self.itl.observe(g)
        if r.finished_s is not None:
            self.e2e.observe(max(0.0, r.finished_s - r.arrival_s))

    def reject(self, status: int) -> None:
        """Count a request answered with an error ``status``."""
        self.rejected.labels(str(status)).inc()
        self.changes = next(self._stamps)

    def exposition(self) -> bytes:
        """The text of ``/metrics``: the snapshot rendered now, the request metrics as last rendered after their
        last change.  ``changes`` is read before rendering, so an update made meanwhile renders them again at the
        next scrape."""
        seen, text = self._rendered
        changes = self.changes
        if changes != seen:
            text = generate_latest(self._requests)
            self._rendered = (changes, text)
        return generate_latest(self._live) + text


def engine_values(e, executor, direct: list[int], kept: dict[str, float], compaction=None,
                  aside=None) -> dict[str, float]:
    """The snapshot's values from engine ``e`` (a StepEngine), its timed ``executor``, the relay's ``direct`` counts
    (frames written, spills), the ``kept`` values of llama.cpp's cells (read only when the engine goes idle), and
    the llama.cpp executor's KV ``compaction`` policy and ``aside`` (a PrefillAside) where it has them."""
    b, s = e.blocks, e.scheduler
    values = {"requests_running": len(s.running), "requests_waiting": len(s.waiting),
              "kv_blocks_used": b.used, "kv_blocks_cached": b.num_cached, "kv_blocks_total": b.capacity,
              "kv_sequences_parked": e.parked, **kept, "engine_steps": executor.steps,
              "engine_step_seconds": executor.step_seconds, "engine_decode_seconds": executor.decode_seconds,
              "admissions": s.admissions, "preemptions": s.preemptions,
              "stream_frames_direct": direct[0], "stream_spills": direct[1]}
    if s.drafter is not None:
        values.update(spec_draft_tokens=s.drafter.drafted, spec_accepted_tokens=s.drafter.accepted)
    if b.snapshots is not None:
        values.update(snapshots=len(b.snapshots), snapshot_bytes=b.snapshots.bytes, snapshots_taken=b.snapshots.taken,
                      snapshots_restored=b.snapshots.restored, snapshot_recomputed_tokens=b.snapshots.recomputed)
    if compaction is not None:
        values.update(kv_compactions=compaction.count, kv_compaction_seconds=compaction.seconds)
    if aside is not None:
        values.update(prefill_aside_bytes=sum(aside.memory.values()), prefill_aside_prompts=aside.prompts,
                      prefill_aside_fallbacks=aside.fallbacks, prefill_aside_seconds=aside.seconds)
    return values
