"""Replay a request trace on the simulated executor, through the real scheduler and block manager.

A trace is a JSON list (or JSON Lines) of ``{"id", "arrival_ms", "input",
"output"}`` with optional ``"prefix"`` (a name) + ``"prefix_len"`` (its first
tokens are the same in every request naming it) and ``"deadline_ms"`` (absolute,
on the trace's clock).  Token ids are drawn from seeded generators named by the
prefix and the request id, so a replay is deterministic.

Summary figures: makespan (last finish), throughput (output tokens / makespan),
goodput (requests done by their deadline / makespan), TTFT = first token −
arrival, ITL = gaps between consecutive tokens (p50 / p95 by linear interpolation).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localinfer.errors import UsageError
from localinfer.plan.paging import DEFAULT_BLOCK_TOKENS, blocks_for, tokens_held
from localinfer.serve.assembly import build_step_engine
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.engine import StepRecord
from localinfer.serve.request import Request
from localinfer.serve.scheduler import SchedulerConfig
from localinfer.serve.simulated import SimulatedExecutor
from localinfer.serve.snapshots import SnapshotPolicy
from localinfer.serve.step_model import StepModel
from localinfer.util.stats import percentile

TOKEN_RANGE = 1 << 30
MAX_TRACE_TOKENS = 1 << 21    # per request, input and output each: beyond any context a model is trained for


@dataclass(frozen=True)
class TraceRequest:
    id: str
    arrival_ms: float
    input: int
    output: int
    prefix: str | None = None
    prefix_len: int = 0
    deadline_ms: float | None = None


def _bad(where: str, field: str, problem: str, fix: str) -> UsageError:
    return UsageError(f"{where}: {field} {problem}", hint=fix, field=field)


def _number(item: dict, key: str, where: str, *, integer: bool, low: float, required: bool = True,
            high: float = math.inf):
    if key not in item:
        if required:
            raise _bad(where, f'"{key}"', "is missing", f'give every request "{key}"')
        return None
    v = item[key]
    ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float))
    if not ok or not math.isfinite(v) or not low <= v <= high:
        kind = "a whole number" if integer else "a number"
        span = f"≥ {low:g}" if high == math.inf else f"between {low:g} and {high:g}"
        raise _bad(where, f'"{key}"', f"must be {kind} {span}, got {v!r}", f'fix "{key}" of this request')
    return v


def parse_trace(items, source: str = "trace") -> list[TraceRequest]:
    """Validate decoded trace entries; UsageError naming the entry and field on anything wrong."""
    if not isinstance(items, list) or not items:
        raise UsageError(f"{source}: a trace is a non-empty JSON list (or JSON Lines) of requests",
                         hint='e.g. [{"id": "r0", "arrival_ms": 0, "input": 2048, "output": 8}]')
    out, seen = [], set()
    for i, item in enumerate(items):
        where = f"{source} entry {i}"
        if not isinstance(item, dict):
            raise _bad(where, "entry", "is not an object", 'each request is {"id", "arrival_ms", "input", "output"}')
        rid = item.get("id")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) in seen:
            raise _bad(where, '"id"', f"must be a unique string, got {rid!r}", "give every request its own id")
        rid = str(rid)
        seen.add(rid)
        unknown = set(item) - {"id", "arrival_ms", "input", "output", "prefix", "prefix_len", "deadline_ms"}
        if unknown:
            raise _bad(where, f'"{min(unknown)}"', "is not a trace field",
                       "fields: id, arrival_ms, input, output, prefix, prefix_len, deadline_ms")
        arrival = _number(item, "arrival_ms", where, integer=False, low=0)
        n_in = _number(item, "input", where, integer=True, low=1, high=MAX_TRACE_TOKENS)
        n_out = _number(item, "output", where, integer=True, low=1, high=MAX_TRACE_TOKENS)
        deadline = _number(item, "deadline_ms", where, integer=False, low=arrival, required=False)
        prefix = item.get("prefix")
        if prefix is not None and not isinstance(prefix, str):
            raise _bad(where, '"prefix"', f"must be a name (string), got {prefix!r}", "name the shared prefix")
        plen = _number(item, "prefix_len", where, integer=True, low=0, required=prefix is not None) or 0
        if plen and prefix is None:
            raise _bad(where, '"prefix_len"', "needs a \"prefix\" name", 'add "prefix": "NAME" or drop prefix_len')
        if plen > n_in:
            raise _bad(where, '"prefix_len"', f"{plen} exceeds input {n_in}", "the prefix is part of the input")
        out.append(TraceRequest(rid, float(arrival), n_in, n_out, prefix, plen,
                                None if deadline is None else float(deadline)))
    return out


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace file: a JSON list, or one JSON object per line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read trace {p}: {exc}", hint="give a readable JSON or JSONL file") from None
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):      # also nesting too deep, an integer of thousands of digits
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except (ValueError, RecursionError) as exc:
                    why = getattr(exc, "msg", None) or ("nested too deeply" if isinstance(exc, RecursionError)
                                                        else str(exc)[:80])
                    raise UsageError(f"{p} line {n}: not JSON ({why})",
                                     hint="a trace is a JSON list or one JSON object per line") from None
    return parse_trace(items, str(p))


def _draw(name: str, n: int) -> tuple[int, ...]:
    rng = np.random.default_rng(zlib.crc32(name.encode("utf-8")))
    return tuple(int(t) for t in rng.integers(0, TOKEN_RANGE, n))


def prefix_tokens(name: str, n: int) -> tuple[int, ...]:
    return _draw("prefix:" + name, n)


def trace_prompt(t: TraceRequest) -> tuple[int, ...]:
    """The request's input tokens: its named prefix's, then its own."""
    head = prefix_tokens(t.prefix, t.prefix_len) if t.prefix else ()
    return head + _draw("request:" + t.id, t.input - len(head))


@dataclass
class ReplayResult:
    requests: list[Request]
    steps: list[StepRecord]
    blocks: BlockManager
    peak_running: int
    kv_bytes_per_token: int | None = None
    state_seconds: float = 0.0        # clock time spent saving and restoring recurrent-state snapshots

    @property
    def total_s(self) -> float:
        return max((r.finished_s for r in self.requests), default=0.0)

    @property
    def peak_kv_bytes(self) -> int | None:
        k = self.kv_bytes_per_token
        return None if k is None else self.blocks.peak_used * self.blocks.block_tokens * k

    def largest_gaps(self, top: int = 5) -> list:
        """The largest gaps between any request's tokens, and the steps that made them (:mod:`.gaps`)."""
        from localinfer.serve.gaps import largest_gaps

        return largest_gaps([s.as_json() for s in self.steps], top)

    def summary(self) -> dict:
        total = self.total_s
        outs = sum(len(r.output) for r in self.requests)
        ttft = [r.ttft_s for r in self.requests if r.ttft_s is not None]
        gaps = [g for r in self.requests for g in r.gaps_s]
        good = sum(r.on_time for r in self.requests)
        ms = (lambda v: None if v is None else v * 1e3)
        return {
            "makespan_ms": total * 1e3, "output_tokens": outs,
            "throughput_tok_s": outs / total if total else None,
            "good_requests": good, "goodput_req_s": good / total if total else None,
            "ttft_p50_ms": ms(percentile(ttft, 0.5)), "ttft_p95_ms": ms(percentile(ttft, 0.95)),
            "itl_p50_ms": ms(percentile(gaps, 0.5)), "itl_p95_ms": ms(percentile(gaps, 0.95)),
        }

    def as_json(self) -> dict:
        reqs = {r.id: {"first_token_ms": None if r.first_token_s is None else r.first_token_s * 1e3,
                       "finish_ms": r.finished_s * 1e3, "max_gap_ms": r.max_gap_s * 1e3,
                       "preemptions": r.preemptions,
                       "queue_ms": None if r.queue_s is None else r.queue_s * 1e3} for r in self.requests}
        return {"total_ms": self.total_s * 1e3, "requests": reqs, "peak_kv_bytes": self.peak_kv_bytes,
                "peak_running": self.peak_running, "peak_kv_blocks": self.blocks.peak_used,
                "block_tokens": self.blocks.block_tokens, "steps": len(self.steps),
                "finish_reasons": {r.id: r.finish_reason.value for r in self.requests},
                "preemptions": sum(r.preemptions for r in self.requests),
                "recomputed_tokens": sum(r.recomputed for r in self.requests),
                "cached_tokens": sum(r.cached for r in self.requests),
                "snapshots": self.snapshot_summary(),
                **self.summary()}

    def snapshot_summary(self) -> dict | None:
        """Recurrent-state snapshots (a hybrid model's replay): how many were saved and restored, the prompt tokens
        matched past the deepest snapshot (recomputed), and the clock time moving states took; None without."""
        snaps = self.blocks.snapshots
        if snaps is None:
            return None
        return {**snaps.as_json(), "state_ms": self.state_seconds * 1e3,
                "requests": {r.id: {"cached": r.cached, "matched": r.cached + r.past_snapshot,
                                    "recomputed_past_snapshot": r.past_snapshot}
                             for r in self.requests if r.cached or r.past_snapshot}}


def replay(trace: list[TraceRequest], config: SchedulerConfig, step_model: StepModel, *,
           block_tokens: int = DEFAULT_BLOCK_TOKENS, kv_blocks: int | None = None,
           kv_bytes_per_token: int | None = None, prefix_cached: bool = False, state_bytes: int = 0,
           snapshot_policy: SnapshotPolicy | None = None, state_bandwidth: float = 32e9) -> ReplayResult:
    """Run ``trace`` to the end; ``kv_blocks`` None: room for the ``max_running`` largest requests and the prefixes.

    ``state_bytes`` > 0 models a hybrid model's recurrent state per sequence: a prefix hit reuses blocks only up to
    the deepest snapshot (taken where ``snapshot_policy`` says), each saved and restored at ``state_bandwidth``."""
    if block_tokens < 1:
        raise UsageError(f"--block must be ≥ 1, got {block_tokens}", flag="--block")
    named: dict[str, int] = {}
    for t in trace:
        if t.prefix:
            named[t.prefix] = max(named.get(t.prefix, 0), t.prefix_len)
    if kv_blocks is None:
        need = sorted((blocks_for(tokens_held(t.input, t.output), block_tokens) for t in trace), reverse=True)
        kv_blocks = sum(need[:config.max_running]) + sum(blocks_for(n, block_tokens) for n in named.values())
    preload = [prefix_tokens(name, n) for name, n in named.items()] if prefix_cached else ()
    executor = SimulatedExecutor(step_model, n_slots=config.max_running, state_bytes=state_bytes,
                                 state_bandwidth=state_bandwidth)
    engine = build_step_engine(executor, config, step_model=step_model, block_tokens=block_tokens,
                               num_blocks=kv_blocks, preload=preload, record=True, snapshot_policy=snapshot_policy,
                               snapshot_budget=None if not state_bytes else 1 << 62)
    scheduler, blocks = engine.scheduler, engine.blocks
    if blocks.snapshots is not None:      # a warm cache of a hybrid model holds the prefixes' states too
        for tokens in preload:
            _preload_snapshots(blocks, tokens, state_bytes)
    reqs = [Request(t.id, trace_prompt(t), t.output, arrival_s=t.arrival_ms / 1e3,
                    deadline_s=None if t.deadline_ms is None else t.deadline_ms / 1e3) for t in trace]
    for r in reqs:
        engine.add_request(r)
    engine.run()
    return ReplayResult(reqs, engine.records, blocks, scheduler.peak_running, kv_bytes_per_token,
                        executor.state_seconds)


def _preload_snapshots(blocks: BlockManager, tokens: tuple[int, ...], state_bytes: int) -> None:
    """States for a preloaded prefix at the snapshot policy's boundaries and at its last whole block, as a request
    that computed it would have left them."""
    from localinfer.backends.executor import SeqState
    from localinfer.serve.prefix_hashes import PrefixHashes

    p, snaps = blocks.block_tokens, blocks.snapshots
    memo = PrefixHashes()
    blocks.cached_run(tokens, memo)       # fills the memo with the prefix's chain hashes
    hashes = memo.values
    for b in {*snaps.policy.boundaries(len(tokens), p), len(tokens) // p * p}:
        if 0 < b <= len(hashes) * p:
            snaps.put(hashes[b // p - 1], SeqState(b, state_bytes))
