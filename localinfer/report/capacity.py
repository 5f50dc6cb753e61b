"""The cross-device capacity report: one dataclass, rendered by small functions.

For every model × device: do the weights fit, the largest context one request
can have (per KV type), how many requests fit at each context, the most
faithful KV type that fits, what offload would cost when the weights do not
fit, and predicted decode/prefill speed and TTFT.  Where measurements exist
(``--bench``) they are shown with the prediction's error.  Renderers: text,
Markdown, JSON here; HTML with inline SVG plots in ``report_html``.  Every
string that came from a file (model names, metadata) is escaped on output.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import asdict, dataclass, field

from gguf_tools.text import safe_text
from localinfer.model.cost import model_cost
from localinfer.plan.calibration import Calibration
from localinfer.plan.speed import SpeedModel, llamacpp_speed_model, speed_band
from localinfer.units import fmt_bytes, fmt_duration

SCHEMA, VERSION = "localinfer.report", 1
KV_ORDER = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")   # most faithful first
CTX_ROUND = 256


@dataclass(frozen=True)
class Cell:
    """One model on one device at one context and KV type (batch 1 speeds)."""

    ctx: int
    kv: str
    kv_bytes: int                      # one request's KV at ctx
    max_requests: int                  # requests of ctx tokens that fit next to the weights
    decode_tok_s: float | None
    prefill_tok_s: float | None
    ttft_s: float | None
    source: str

    @property
    def fits(self) -> bool:
        return self.max_requests >= 1


@dataclass(frozen=True)
class Measured:
    """A measurement next to the prediction for the same condition."""

    kind: str                          # "decode" or "prefill"
    ctx: int
    kv: str
    measured_tok_s: float
    predicted_tok_s: float

    @property
    def error(self) -> float:
        return self.predicted_tok_s / self.measured_tok_s - 1


@dataclass(frozen=True)
class StreamedOffload:
    """Weight offload that makes the weights fit (None where they fit, or there is no link)."""

    groups: int
    kinds: str
    net_bytes: int
    copy_s_per_step: float
    decode_tok_s: float


@dataclass(frozen=True)
class Row:
    """One model on one device."""

    model: str
    device: str
    display_name: str
    usable_bytes: int
    weight_bytes: int
    weights_fit: bool
    kv_budget_bytes: int
    largest_ctx: dict[str, int]        # per KV type, one request
    cheapest_kv: dict[int, str | None]  # per context: most faithful KV type that fits
    cells: tuple[Cell, ...]
    offload: StreamedOffload | None = None
    measured: tuple[Measured, ...] = ()
    power_w: float | None = None
    # how sure the speeds are: the calibration's 90th-percentile errors for this device kind and size class, and
    # what set the coefficients (llama.cpp's kernel model); None where a profile's measured table or a calibration
    # sets them
    speed_band: dict | None = None

    def cell(self, ctx: int, kv: str) -> Cell | None:
        return next((c for c in self.cells if c.ctx == ctx and c.kv == kv), None)


@dataclass(frozen=True)
class Report:
    """The whole matrix: a Row per model × device, plus notes and the figures' data."""

    models: tuple[str, ...]
    devices: tuple[str, ...]
    contexts: tuple[int, ...]
    kv_types: tuple[str, ...]
    rows: tuple[Row, ...]
    created: str = ""
    notes: tuple[str, ...] = ()
    plots: dict = field(default_factory=dict, compare=False)   # data behind the HTML figures

    def rows_for(self, model: str) -> list[Row]:
        return [r for r in self.rows if r.model == model]


# ---- building --------------------------------------------------------------------------------

def build_row(spec, device, contexts, kv_types, calibration: Calibration | None = None) -> Row:
    """Capacity and speed of one model (``ModelSpec``) on one device profile.

    Memory comes from ``localinfer.plan.fit`` (weights placed as llama.cpp places them,
    KV cells, compute and output buffers) at each context and KV type; requests
    and the largest context extend its KV term linearly (a hybrid's recurrent state is per request, so it
    counts in the requests, not in the largest context).
    """
    from localinfer.backends.memory import MAX_PARALLEL, FitRequest
    from localinfer.model.kv import kv_bytes_per_token
    from localinfer.plan.fit import fit_device

    cost = model_cost(spec)
    speed = llamacpp_speed_model(spec, device, calibration, table_first=False)     # as fit: llama.cpp kernels
    usable = device.usable_bytes
    cells, largest, cheapest, fixed0 = [], {}, {}, None
    for kv in kv_types:
        for ctx in contexts:
            bd = fit_device(spec, device, FitRequest(n_ctx=ctx, type_k=kv, type_v=kv), search=False).breakdown
            kv_dev = bd.sum("kv", "device") + bd.sum("state", "device")   # per request: KV and recurrent state
            fixed = bd.device_bytes - kv_dev                 # weights on the device, compute, output
            fixed0 = fixed if fixed0 is None else min(fixed0, fixed)
            n = min(max(0, usable - fixed) // kv_dev, MAX_PARALLEL) if kv_dev else 0
            if fixed < usable and n:
                pre, dec = speed.prefill(1, ctx), speed.decode_step(1, ctx, kv)
                cells.append(Cell(ctx, kv, kv_dev, int(n), _rate(1, dec.seconds), _rate(ctx, pre.seconds),
                                  _finite(pre.seconds), dec.source))
            else:
                cells.append(Cell(ctx, kv, kv_dev, 0, None, None, None, "does not fit"))
        per_token = kv_bytes_per_token(spec, kv, kv)
        cap = max(0, usable - fixed0) // per_token // CTX_ROUND * CTX_ROUND if per_token else 0
        largest[kv] = min(cap, spec.n_ctx_train) if spec.n_ctx_train else cap
    for ctx in contexts:
        ok = [kv for kv in kv_types if next(c for c in cells if c.ctx == ctx and c.kv == kv).fits]
        cheapest[ctx] = min(ok, key=_faithfulness) if ok else None
    budget = usable - fixed0
    return Row(spec.name, device.name, device.display_name, usable, cost.weight_bytes, budget > 0, budget,
               largest, cheapest, tuple(cells), _offload(spec, device, speed, contexts, budget),
               _measured(speed, calibration) if calibration else (), getattr(device, "power_w", None),
               speed_band(speed.kernels) if speed.kernels is not None and calibration is None else None)


def _faithfulness(kv: str) -> int:
    return KV_ORDER.index(kv) if kv in KV_ORDER else len(KV_ORDER)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds and math.isfinite(seconds) else None


def _finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _offload(spec, device, speed: SpeedModel, contexts, budget: int) -> StreamedOffload | None:
    """When the weights overflow: stream enough groups for one request at the smallest context."""
    from localinfer.errors import UsageError
    from localinfer.plan.offload import plan_offload

    need = speed.cost.kv_read_bytes(min(contexts)) - budget
    if need <= 0 or device.unified or not device.link_bytes_per_s:
        return None
    step = speed.decode_step(1, min(contexts))
    try:
        p = plan_offload(spec, device, free_bytes=need, buffers=2, step_compute_s=step.seconds)
    except UsageError:
        return None
    kinds = "+".join(sorted({g.kind for g in p.groups}))
    return StreamedOffload(len(p.groups), kinds, p.net_bytes, p.copy_s_per_step, _rate(1, p.step_s) or 0.0)


def _measured(speed: SpeedModel, cal: Calibration) -> tuple[Measured, ...]:
    """Each measurement beside a prediction made without it (leave-one-out)."""
    out = []
    for s in cal.decode:
        rest = Calibration(tuple(x for x in cal.decode if x is not s), cal.prefill)
        pred = SpeedModel(speed.cost, speed.device, rest if rest.decode else None,
                          kernels=speed.kernels).decode_step(s.batch, s.context, s.kv)
        if math.isfinite(pred.seconds):
            kv = s.kv if isinstance(s.kv, str) else s.kv[0]
            out.append(Measured("decode", s.context, kv, 1 / s.seconds, 1 / pred.seconds))
    for s in cal.prefill:
        rest = Calibration(cal.decode, tuple(x for x in cal.prefill if x is not s))
        pred = SpeedModel(speed.cost, speed.device, rest if rest.prefill else None, kernels=speed.kernels).prefill(
            s.batch, s.new_tokens, s.cached_tokens)
        if math.isfinite(pred.seconds):
            out.append(Measured("prefill", s.new_tokens, "-", s.new_tokens / s.seconds, s.new_tokens / pred.seconds))
    return tuple(out)


def _mapped_notes(specs, devices, n_ctx: int) -> list[str]:
    """Where the memory that must stay resident (what the table counts) is less than what is mapped."""
    from localinfer.backends.memory import FitRequest
    from localinfer.plan.fit import fit_device, mapped_note

    out = []
    for s in specs:
        for d in devices:
            bd = fit_device(s, d, FitRequest(n_ctx=n_ctx), search=False).breakdown
            note = mapped_note(bd)
            if note:
                out.append(f"{clean(s.name)} on {clean(d.name)} at {n_ctx} tokens: {fmt_bytes(bd.resident_bytes)} "
                           f"resident (counted); {note}")
    return out


def build_report(specs, devices, contexts, kv_types, *, calibrations: dict | None = None, plots: bool = False,
                 workload=None) -> Report:
    """Every model × device.  ``calibrations`` maps a device name to its measurements."""
    calibrations = calibrations or {}
    rows = tuple(build_row(s, d, contexts, kv_types, calibrations.get(d.name)) for s in specs for d in devices)
    notes = [("memory as `localinfer fit` counts it (llama.cpp placement, KV cells, compute and output buffers) "
              "against each device's usable memory; requests and largest ctx extend the KV term linearly; "
              "llama.cpp serves at most 256 sequences"),
             ("speeds are batch 1 with the KV type shown; offload streams weight groups over the host link "
              "with two prefetch buffers"),
             ("speeds come from llama.cpp's kernel model (fixed times, per-type bandwidth shares, per-path peaks) "
              "fitted to published llama-bench results per device kind, unless measured (--bench) or set by a "
              "profile's measured efficiency table; ±N% is the 90th-percentile error of that calibration for the "
              "kind and the model's size class, * where the device itself was not among the calibration's devices "
              "(docs/speed.md)"),
             "largest ctx stops at the model's trained context length"]
    notes += _mapped_notes(specs, devices, min(contexts))
    for s in specs:
        over = [c for c in contexts if s.n_ctx_train and c > s.n_ctx_train]
        if over:
            notes.append(f"{clean(s.name)}: contexts {', '.join(map(str, over))} exceed its trained "
                         f"length {s.n_ctx_train}")
    report = Report(tuple(s.name for s in specs), tuple(d.name for d in devices), tuple(contexts),
                    tuple(kv_types), rows,
                    datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), tuple(notes))
    if plots:
        from localinfer.report.plots import plot_data

        report.plots.update(plot_data(specs, devices, contexts, kv_types, workload))
    return report


# ---- rendering -------------------------------------------------------------------------------

def clean(text) -> str:
    """A file-supplied string made safe for a terminal: control characters shown, length capped."""
    return safe_text(str(text), 120)


def _tok(x: float | None) -> str:
    return "—" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}")


def _ctx(n: int) -> str:
    if n < 1024:
        return str(n)
    k = n / 1024
    return f"{k:.0f}K" if k >= 100 or k == int(k) else f"{k:.1f}K"


def table(report: Report, model: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) for one model: a row per device and context; device facts on its first row.

    Speeds are those of the most faithful KV type that fits (the "KV" column).
    """
    kvs = "/".join(report.kv_types)
    kv0 = report.kv_types[0]
    head = ["device", "usable", "weights", f"largest ctx {kvs}", "ctx", f"requests {kvs}", "KV",
            "decode tok/s", "prefill tok/s", "TTFT", "offload"]
    rows = []
    for r in report.rows_for(model):
        o = r.offload
        first = [clean(r.device), fmt_bytes(r.usable_bytes), "fits" if r.weights_fit else "too big",
                 "/".join(_ctx(r.largest_ctx[k]) if r.largest_ctx[k] else "—" for k in report.kv_types)]
        off = "—" if o is None else f"{o.groups} {o.kinds} groups, {fmt_duration(o.copy_s_per_step)}/step, {_tok(o.decode_tok_s)} tok/s"
        for i, c in enumerate(report.contexts):
            cells = [r.cell(c, k) for k in report.kv_types]
            head_cells = first if i == 0 else ["", "", "", ""]
            c0 = r.cell(c, r.cheapest_kv[c] or kv0)
            rows.append([*head_cells, _ctx(c), "/".join(str(x.max_requests) for x in cells), r.cheapest_kv[c] or "none",
                         _tok(c0.decode_tok_s) + _band(r, "decode", c0.decode_tok_s),
                         _tok(c0.prefill_tok_s) + _band(r, "prefill", c0.prefill_tok_s), fmt_duration(c0.ttft_s),
                         off if i == 0 else ""])
    return head, rows


def _band(r: Row, kind: str, value: float | None) -> str:
    """`` ±17%`` (the calibration's error band for this device), with ``*`` where the device itself was not among
    the calibration's devices; nothing where no kernel model set the speed."""
    band = r.speed_band
    if band is None or value is None or band.get(f"{kind}_error") is None:
        return ""
    return f" ±{100 * band[f'{kind}_error']:.0f}%" + ("" if band["speed_calibration"]["this_device_calibrated"] else "*")


def measured_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of measurements beside their predictions, all models and devices."""
    head = ["model", "device", "kind", "ctx", "KV", "measured tok/s", "predicted tok/s", "error"]
    rows = [[clean(r.model), clean(r.device), m.kind, str(m.ctx), m.kv, _tok(m.measured_tok_s),
             _tok(m.predicted_tok_s), f"{100 * m.error:+.1f}%"] for r in report.rows for m in r.measured]
    return head, rows


def render_text(report: Report) -> str:
    """Aligned plain-text tables for a terminal."""
    out = []
    for model in report.models:
        head, rows = table(report, model)
        out.append(clean(model))
        out.append(_aligned(head, rows))
        out.append("")
    head, rows = measured_table(report)
    if rows:
        out += ["measured vs predicted (each prediction made without that measurement)", _aligned(head, rows), ""]
    out += [f"note: {n}" for n in report.notes]
    return "\n".join(out)


def _aligned(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *rows])


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render_md(report: Report) -> str:
    """GitHub-flavoured Markdown tables (pipes and angle brackets escaped)."""
    out = ["# localinfer capacity report", ""]
    for model in report.models:
        head, rows = table(report, model)
        out += [f"## {_md_cell(clean(model))}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
        out.append("")
    head, rows = measured_table(report)
    if rows:
        out += ["## Measured vs predicted", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
        out.append("")
    out += [f"- {_md_cell(n)}" for n in report.notes]
    return "\n".join(out) + "\n"


def to_dict(report: Report) -> dict:
    """The report as versioned JSON-ready data (schema ``localinfer.report`` v1)."""
    d = asdict(report)
    d.pop("plots", None)
    for row in d["rows"]:
        row["cheapest_kv"] = {str(k): v for k, v in row["cheapest_kv"].items()}
    return {"schema": SCHEMA, "version": VERSION, **d}


def render_json(report: Report) -> str:
    """JSON text (non-ASCII and control characters escaped)."""
    return json.dumps(to_dict(report), indent=1, ensure_ascii=True)
