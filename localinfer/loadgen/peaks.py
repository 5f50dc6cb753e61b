"""Peaks of a server's KV use while a load runs: ``/metrics`` gauges and llama-server's ``GET /slots``.

The keys of ``peaks`` (each the largest value seen) are described in :mod:`localinfer.loadgen.load`:
``localinfer_kv_blocks_used`` (x 16 tokens per block), ``localinfer_requests_running``,
``llamacpp:kv_cache_tokens``, ``llamacpp:requests_processing`` and ``llama_server_slot_tokens``
(the sum over llama-server's processing slots of ``n_prompt_tokens + next_token[0].n_decoded``).
"""

from __future__ import annotations

import asyncio
from typing import Self

try:
    import httpx
except ImportError:  # optional: loadgen refuses to start without it
    httpx = None

BLOCK_TOKENS = 16
PEAK_GAUGES = {"localinfer_kv_blocks_used": BLOCK_TOKENS, "llamacpp:kv_cache_tokens": 1,
               "localinfer_requests_running": 1, "llamacpp:requests_processing": 1}
SLOT_PEAK = "llama_server_slot_tokens"
COUNTERS = ("localinfer_engine_step_seconds_total", "localinfer_engine_decode_seconds_total",
            "localinfer_engine_steps_total")


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def slot_tokens(slots: list) -> int:
    """Σ over llama-server's processing slots (``GET /slots``) of ``n_prompt_tokens + next_token[0].n_decoded``."""
    total = 0
    for s in slots:
        if not isinstance(s, dict) or not s.get("is_processing"):
            continue
        nxt = s.get("next_token")
        if isinstance(nxt, list):
            nxt = nxt[0] if nxt else None
        decoded = nxt.get("n_decoded") if isinstance(nxt, dict) else None
        total += _count(s.get("n_prompt_tokens")) + _count(decoded)
    return total


class PeakWatcher:
    """Polls ``/metrics`` and ``/slots`` while a run goes: the peaks described in the module docstring, and how
    much each of COUNTERS grew.  A server whose first ``/slots`` answer is not a 200 list is not asked again."""

    def __init__(self, client, root: str, poll_s: float = 0.2):
        self.client, self.poll_s, self.peaks = client, poll_s, {}
        self.metrics_url, self.slots_url = root + "/metrics", root + "/slots"
        self.slots_seen = False
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tasks: list[asyncio.Task] = []

    def _peak(self, name: str, value: float) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0.0), value)

    async def sample(self) -> None:
        await asyncio.gather(self.sample_metrics(), self.sample_slots())

    async def sample_metrics(self) -> None:
        try:
            text = (await self.client.get(self.metrics_url, timeout=5)).text
        except httpx.HTTPError:
            return
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            try:
                v = float(value)
            except ValueError:
                continue
            if name in PEAK_GAUGES:
                self._peak(name, v * PEAK_GAUGES[name])
            elif name in COUNTERS:
                self.first.setdefault(name, v)
                self.last[name] = v

    async def sample_slots(self) -> None:
        if self.slots_url is None:
            return
        try:
            r = await self.client.get(self.slots_url, timeout=5)
            slots = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return
        if not isinstance(slots, list):
            if not self.slots_seen:
                self.slots_url = None
            return
        self.slots_seen = True
        self._peak(SLOT_PEAK, slot_tokens(slots))

    async def _poll(self, sample) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await sample()

    def grown(self) -> dict[str, float]:
        return {k.removeprefix("localinfer_"): round(self.last[k] - self.first[k], 3) for k in self.last}

    async def __aenter__(self) -> Self:
        await self.sample()
        self.tasks = [asyncio.ensure_future(self._poll(f)) for f in (self.sample_metrics, self.sample_slots)]
        return self

    async def __aexit__(self, *exc) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if exc[0] is None:
            await self.sample()
