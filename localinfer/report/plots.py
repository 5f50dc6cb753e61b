"""The numbers behind the report's figures (plain data; ``report_html`` draws them).

* bytes per output token against batch (docs/speed.md): d(b, L) = D_w/b + L·k
  for each context, the KV term L·k alone, and the weight share D_w/b;
* the memory × time feasibility map: every configuration of a
  workload on each device, KV(+draft) memory against batch completion time, with
  the KV budget and the deadline;
* capacity against context: requests that fit per device as the context grows.
"""

from __future__ import annotations

import math

from localinfer.model.cost import model_cost
from localinfer.plan.planner import candidate_configs, plan
from localinfer.plan.speed import Workload, llamacpp_speed_model

BATCHES = tuple(2 ** i for i in range(9))            # 1 … 256


def bytes_per_token(spec, contexts) -> dict:
    """Series for the bytes-per-token plot: d(b, L) per context, the KV term alone, and the weight share."""
    cost = model_cost(spec)
    series = []
    for ctx in contexts:
        series.append({"label": f"{ctx} ctx", "kind": "total",
                       "points": [(b, cost.per_token_read_bytes(b, ctx)) for b in BATCHES]})
        series.append({"label": f"KV only, {ctx}", "kind": "kv",
                       "points": [(b, float(cost.kv_read_bytes(ctx))) for b in BATCHES]})
    series.append({"label": "weights / batch", "kind": "weights",
                   "points": [(b, cost.decode_read_bytes(b) / b) for b in BATCHES]})
    return {"model": spec.name, "x": "requests in the batch", "y": "bytes read per output token", "series": series}


def feasibility(spec, devices, workload: Workload, kv_types) -> list[dict]:
    """One map per device: each configuration's (memory, total time, verdict)."""
    cost = model_cost(spec)
    maps = []
    for dev in devices:
        budget = dev.usable_bytes - cost.weight_bytes
        if budget <= 0:
            continue
        speed = llamacpp_speed_model(spec, dev, table_first=False)
        p = plan(speed, workload, budget, candidate_configs(workload, kv_types=kv_types))
        pts = [{"name": o.name, "label": o.config.label, "memory": o.memory_bytes, "seconds": o.total_s,
                "verdict": o.verdict} for o in p.outcomes if math.isfinite(o.total_s)]
        if pts:
            maps.append({"device": dev.name, "budget": budget, "deadline": workload.deadline_s, "points": pts,
                         "best": p.best.name if p.best else None})
    return maps


def capacity(spec, devices, kv: str = "f16") -> dict:
    """Series of requests that fit (weights aside) against context, one per device."""
    cost = model_cost(spec)
    contexts = [2 ** i for i in range(10, 18)]          # 1K … 128K
    series = []
    for dev in devices:
        budget = dev.usable_bytes - cost.weight_bytes
        pts = [(c, budget // cost.kv_read_bytes(c, kv)) for c in contexts if budget > 0]
        pts = [(c, n) for c, n in pts if n >= 1]
        if pts:
            series.append({"label": dev.name, "points": pts})
    return {"model": spec.name, "kv": kv, "x": "context per request (tokens)", "y": "requests that fit",
            "series": series}


def plot_data(specs, devices, contexts, kv_types, workload: Workload | None = None) -> dict:
    """All figures for the first model."""
    spec = specs[0]
    w = workload or Workload(16, sorted(contexts)[len(contexts) // 2], 256, deadline_s=7.0)
    return {"bytes_per_token": bytes_per_token(spec, contexts[:3]),
            "feasibility": {"model": spec.name, "workload": w.__dict__,
                            "maps": feasibility(spec, devices, w, kv_types)},
            "capacity": capacity(spec, devices, kv_types[0])}
