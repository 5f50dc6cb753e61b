"""The plan rendered as text: an aligned table of configurations, the choice, and why each other one lost."""

from __future__ import annotations

import math

from gguf_tools.text import safe_text


def _s(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{x:.2f} s"


def split_speed_unknown(speed) -> str | None:
    """Why a --split plan has no speed where its host cannot compute (a unified-memory profile: bandwidth, no CPU
    cores or FLOP/s); None elsewhere (a device without a measurement: ``bench --json`` says)."""
    work = getattr(speed, "host", None)          # plan/split_plan.SplitSpeedModel's host stage (HostWork)
    if work is None or work.host.computes:
        return None
    return (f"speed unknown: fit --devices' plan keeps weights in the RAM of {safe_text(work.host.name, 200)}, whose "
            "profile gives no CPU cores or FLOP/s to compute a prompt's share with (`bench --json` does not time a "
            "--split); put a device whose host has cores first in --split (localinfer devices lists them)")


def unknown_reasons(p, why: str) -> dict[str, str]:
    """``p``'s reasons, those of configurations whose speed is unknown replaced by ``why`` (where
    :func:`split_speed_unknown` says why in one line for all of them)."""
    from localinfer.plan.planner import UNKNOWN

    verdict = {o.name: o.verdict for o in p.outcomes}
    return {n: why if verdict.get(n) == UNKNOWN else r for n, r in p.reasons.items()}


def render_text(spec, speed, p) -> str:
    """The plan as an aligned table, the choice, and why each other configuration lost."""
    from localinfer.plan.planner import UNKNOWN
    from localinfer.units import fmt_bytes, fmt_duration

    w, dev = p.workload, speed.device
    shared = f" (first {w.shared_prefix} shared)" if w.shared_prefix else ""
    deadline = f"deadline {w.deadline_s:g} s" if w.deadline_s else "no deadline"
    src = speed.calibration.cal.source if speed.calibration else "device profile efficiencies"
    lines = [f"{safe_text(spec.name, 200)} on {safe_text(dev.display_name, 200)}",
             (f"{w.requests} request(s) × {w.input_tokens} tokens in{shared} → {w.output_tokens} out; {deadline}; "
              f"KV budget {fmt_bytes(p.budget_bytes)}; speed from {safe_text(src, 200)}"), ""]
    head = ("", "configuration", "KV+draft", "prefill", "decode", "total", "verdict", "GPU·s/good", "J/good")
    rows = [head]
    for o in p.outcomes:
        t = o.timing
        label = o.config.label
        if o.offload is not None:
            off = o.offload
            label += (f" ({len(off.groups)} groups, copy {fmt_duration(off.copy_s_per_step)}/step"
                      f"{', hidden' if off.copy_hidden else ''})")
        rows.append((o.name, label, fmt_bytes(o.memory_bytes), _s(t.prefill.seconds),
                     f"{t.steps} × {fmt_duration(t.step.seconds)}", _s(t.total_s), o.verdict,
                     "—" if not math.isfinite(o.gpu_s_per_good) else f"{o.gpu_s_per_good:.3f}",
                     "—" if o.joules_per_good is None or not math.isfinite(o.joules_per_good)
                     else f"{o.joules_per_good:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.append("")
    unknown = split_speed_unknown(speed) if p.best is None else None
    if p.best is None and any(o.verdict == UNKNOWN for o in p.outcomes):
        lines.append(unknown or f"speed unknown on {safe_text(dev.name, 200)}: measure it with "
                                "`localinfer bench --json FILE` and pass --bench FILE")
    elif p.best is None:
        lines.append("nothing is feasible: relax the deadline, shorten the output, add memory, "
                     "or draft from the context (no device memory)")
    else:
        b = p.best
        joules = f" and {b.joules_per_good:.0f} J" if b.joules_per_good is not None else ""
        lines.append(f"best: {b.name} ({b.config.label}): {b.verdict} in {b.total_s:.2f} s; "
                     f"{b.gpu_s_per_good:.3f} GPU·s{joules} per good result")
    lines.append("why not the others:" if p.best else "why each one fails:")
    reasons = unknown_reasons(p, "fits, speed unknown (above)") if unknown else p.reasons
    lines += [f"  {name}: {why}" for name, why in reasons.items()]
    v = prefix_note(speed, w)
    if v is not None:
        lines += ["", v]
    return "\n".join(lines)


def prefix_note(speed, w) -> str | None:
    """What keeping the shared prefix cached between batches is worth (V_h = p_h (T_r − T_f) − T_m)."""
    from localinfer.plan.prefix_value import prefix_value
    from localinfer.units import fmt_bytes

    if not w.shared_prefix:
        return None
    v = prefix_value(speed, w.shared_prefix, 0.5)
    if not math.isfinite(v.recompute_s):
        return None
    head = f"shared prefix: {w.shared_prefix} tokens, {fmt_bytes(v.bytes)} of KV; recompute {v.recompute_s * 1e3:.1f} ms"
    if not v.fetch_s:
        return f"{head}; on unified memory it never moves, so any reuse pays for the memory it holds"
    return (f"{head}, fetch from host {v.fetch_s * 1e3:.1f} ms, write-back {v.maintain_s * 1e3:.1f} ms; "
            f"keeping it pays when more than {100 * v.break_even_prob:.1f}% of requests reuse it "
            f"({v.value_s * 1e3:.1f} ms saved per request at 50%)")
