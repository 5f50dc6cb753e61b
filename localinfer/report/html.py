"""The report as one self-contained HTML page: tables plus inline SVG figures (no scripts, no CDN)."""

from __future__ import annotations

from html import escape

from localinfer.report.capacity import Report, clean, measured_table, table
from localinfer.report.svg import feasibility_map, line_chart
from localinfer.units import GiB, MiB

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.bad{color:#b00}.figs{display:flex;flex-wrap:wrap;gap:16px}.note{color:#555;font-size:12px}
"""


def _bytes_label(v: float) -> str:
    if v >= GiB:
        return f"{v / GiB:g} GiB"
    if v >= MiB:
        return f"{v / MiB:g} MiB"
    return f"{v / 1024:g} KiB" if v >= 1024 else f"{v:g} B"


def _gib(v: float) -> str:
    return f"{v:g} GiB"


def _seconds(v: float) -> str:
    return f"{v:g} s"


def _count(v: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if v >= div:
            return f"{v / div:g}{unit}"
    return f"{v:g}"


def _ctx_label(v: float) -> str:
    return f"{v / 1024:g}K" if v >= 1024 else f"{v:g}"


def _table_html(head: list[str], rows: list[list[str]]) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        tds = "".join(f'<td{" class=bad" if c in ("too big", "none") else ""}>{escape(c)}</td>' for c in r)
        out.append(f"<tr>{tds}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _figures(plots: dict) -> list[str]:
    out = []
    bpt = plots.get("bytes_per_token")
    if bpt:
        styles = {"total": "", "kv": "2 4", "weights": "8 4"}
        series = []
        for i, s in enumerate(bpt["series"]):
            color = "#7f7f7f" if s["kind"] == "weights" else None
            series.append({**s, "dash": styles[s["kind"]], "color": color})
        # totals and their KV floors share a colour per context
        colors = iter(("#1f77b4", "#1f77b4", "#2ca02c", "#2ca02c", "#9467bd", "#9467bd"))
        for s in series:
            if s["kind"] != "weights":
                s["color"] = next(colors, None)
        out.append(line_chart(f"Bytes read per output token — {clean(bpt['model'])}", series, bpt["x"], bpt["y"],
                              fx=_count, fy=_bytes_label, x_base=2, y_base=4))
    cap = plots.get("capacity")
    if cap and cap["series"]:
        out.append(line_chart(f"Requests that fit vs context ({cap['kv']} KV) — {clean(cap['model'])}", cap["series"],
                              cap["x"], cap["y"], fx=_ctx_label, fy=_count, x_base=2))
    feas = plots.get("feasibility")
    if feas:
        w = feas["workload"]
        for m in feas["maps"]:
            title = (f"{m['device']}: {w['requests']}×{w['input_tokens']}→{w['output_tokens']}"
                     + (f", best {m['best']}" if m["best"] else ", nothing feasible"))
            pts = [{**p, "memory": p["memory"] / GiB} for p in m["points"]]
            out.append(feasibility_map(title, pts, m["budget"] / GiB, m["deadline"], fx=_gib, fy=_seconds))
        names = {p["name"]: p["label"] for m in feas["maps"] for p in m["points"]}
        if names:
            items = "".join(f"<li><b>{escape(k)}</b> {escape(v)}</li>" for k, v in names.items())
            out.append(f'<ul class="note" style="flex-basis:100%">{items}</ul>')
    return out


def render_html(report: Report) -> str:
    """The whole page; every string from a model file or profile is escaped."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>localinfer capacity report</title>", f"<style>{_CSS}</style></head><body>",
             "<h1>localinfer capacity report</h1>",
             (f'<p class="note">{escape(report.created)} · devices: {escape(", ".join(report.devices))} · '
              f'contexts: {escape(", ".join(map(str, report.contexts)))} · KV: {escape(", ".join(report.kv_types))}</p>')]
    for model in report.models:
        head, rows = table(report, model)
        parts += [f"<h2>{escape(clean(model))}</h2>", _table_html(head, rows)]
    head, rows = measured_table(report)
    if rows:
        parts += ["<h2>Measured vs predicted</h2>", _table_html(head, rows)]
    figs = _figures(report.plots)
    if figs:
        fw = report.plots.get("feasibility", {}).get("workload", {})
        parts += ["<h2>Figures</h2>",
                  ('<p class="note">Feasibility maps: each letter is a configuration (hover for its name); '
                   f'{escape(str(fw.get("requests", "")))} requests arriving together; green shade = within the KV '
                   "budget and the deadline.</p>"),
                  '<div class="figs">', *figs, "</div>"]
    parts += ["<ul class=note>", *[f"<li>{escape(n)}</li>" for n in report.notes], "</ul></body></html>"]
    return "\n".join(parts)
