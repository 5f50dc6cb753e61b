"""Small inline-SVG charts (no JavaScript, no external files): lines on log axes and a feasibility map.

Every label goes through ``html.escape``; numbers are formatted by the caller's
functions.  The output is a standalone ``<svg>`` element to paste into HTML.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
MARGIN = (64, 16, 36, 48)            # left, right, top, bottom


class Axes:
    """Maps data to pixels on linear or log axes."""

    def __init__(self, xs, ys, width, height, log_x, log_y, pad=0.04, right=MARGIN[1], x_base=10, y_base=10):
        self.w, self.h, self.log_x, self.log_y = width, height, log_x, log_y
        self.right, self.bases = right, {"x": x_base, "y": y_base}
        self.x0, self.x1 = self._span(xs, log_x, pad)
        self.y0, self.y1 = self._span(ys, log_y, pad)

    @staticmethod
    def _span(vals, log, pad):
        vals = [v for v in vals if v is not None and math.isfinite(v) and (v > 0 or not log)]
        lo, hi = (min(vals), max(vals)) if vals else (1.0, 10.0)
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi == lo:
            hi, lo = hi + 0.5, lo - 0.5
        d = (hi - lo) * pad
        return lo - d, hi + d

    def _t(self, v, log):
        return math.log10(v) if log else v

    def px(self, x: float) -> float:
        left, right = MARGIN[0], self.w - self.right
        return left + (self._t(x, self.log_x) - self.x0) / (self.x1 - self.x0) * (right - left)

    def py(self, y: float) -> float:
        top, bottom = MARGIN[2], self.h - MARGIN[3]
        return bottom - (self._t(y, self.log_y) - self.y0) / (self.y1 - self.y0) * (bottom - top)

    def ticks(self, axis: str, n: int = 6) -> list[float]:
        lo, hi, log = (self.x0, self.x1, self.log_x) if axis == "x" else (self.y0, self.y1, self.log_y)
        if log:
            base = self.bases[axis]
            k0, k1 = math.ceil(lo / math.log10(base) - 1e-9), math.floor(hi / math.log10(base) + 1e-9)
            step = max(1, math.ceil((k1 - k0 + 1) / n))
            return [base ** k for k in range(k0, k1 + 1, step)]
        raw = (hi - lo) / n
        mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
        step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
        return [i * step for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _frame(ax: Axes, title: str, x_label: str, y_label: str, fx, fy) -> list[str]:
    w, h = ax.w, ax.h
    left, right, top, bottom = MARGIN[0], w - ax.right, MARGIN[2], h - MARGIN[3]
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="sans-serif" font-size="11" role="img" aria-label="{escape(title)}">'),
           f'<rect x="0" y="0" width="{w}" height="{h}" fill="#fff"/>',
           f'<text x="{w / 2:.0f}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{escape(title)}</text>']
    for t in ax.ticks("x"):
        x = ax.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{escape(fx(t))}</text>')
    for t in ax.ticks("y"):
        y = ax.py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{escape(fy(t))}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{(left + right) / 2:.0f}" y="{h - 8}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(12,{(top + bottom) / 2:.0f}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    return out


def line_chart(title: str, series: list[dict], x_label: str, y_label: str, *, fx=str, fy=str, log_x=True,
               log_y=True, width=640, height=360, x_base=10, y_base=10, legend_width=150) -> str:
    """Lines through ``series[i]["points"]`` [(x, y)], with optional ``dash``; the legend sits on the right."""
    xs = [x for s in series for x, _ in s["points"]]
    ys = [y for s in series for _, y in s["points"]]
    ax = Axes(xs, ys, width, height, log_x, log_y, right=legend_width + 12, x_base=x_base, y_base=y_base)
    out = _frame(ax, title, x_label, y_label, fx, fy)
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        pts = " ".join(f"{ax.px(x):.1f},{ax.py(y):.1f}" for x, y in s["points"]
                       if (x > 0 or not log_x) and (y > 0 or not log_y))
        dash = f' stroke-dasharray="{s["dash"]}"' if s.get("dash") else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        ly = MARGIN[2] + 12 + 14 * i
        lx = width - legend_width
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 18}" y2="{ly - 4}" stroke="{color}" stroke-width="2"{dash}/>'
                   f'<text x="{lx + 22}" y="{ly}">{escape(s["label"])}</text>')
    out.append("</svg>")
    return "\n".join(out)


def feasibility_map(title: str, points: list[dict], budget: float, deadline: float | None, *, fx=str, fy=str,
                    width=420, height=300) -> str:
    """Memory × time: each point a configuration; dashed limits, the feasible corner shaded."""
    xs = [p["memory"] for p in points] + [budget, 0]
    ys = [p["seconds"] for p in points] + ([deadline] if deadline else []) + [0]
    ax = Axes(xs, ys, width, height, False, False, pad=0.08)
    out = _frame(ax, title, "KV (+ draft) memory", "time for the whole batch", fx, fy)
    x0, y0 = ax.px(max(0.0, ax.x0)), ax.py(max(0.0, ax.y0))
    xb = ax.px(budget)
    yd = ax.py(deadline) if deadline else MARGIN[2]
    out.append(f'<rect x="{x0:.1f}" y="{yd:.1f}" width="{max(xb - x0, 0):.1f}" height="{max(y0 - yd, 0):.1f}" '
               f'fill="#2ca02c" fill-opacity="0.10"/>')
    out.append(f'<line x1="{xb:.1f}" y1="{MARGIN[2]}" x2="{xb:.1f}" y2="{height - MARGIN[3]}" stroke="#d62728" '
               f'stroke-dasharray="6 4"/><text x="{xb - 3:.1f}" y="{height - MARGIN[3] - 4}" text-anchor="end" '
               f'fill="#d62728">budget</text>')
    if deadline:
        out.append(f'<line x1="{MARGIN[0]}" y1="{yd:.1f}" x2="{width - MARGIN[1]}" y2="{yd:.1f}" stroke="#d62728" '
                   f'stroke-dasharray="6 4"/><text x="{width - MARGIN[1] - 4}" y="{yd - 4:.1f}" text-anchor="end" '
                   f'fill="#d62728">deadline</text>')
    colors = {"on time": "#2ca02c", "fits": "#2ca02c", "late": "#ff7f0e", "does not fit": "#d62728"}
    for p in points:
        x, y = ax.px(p["memory"]), ax.py(p["seconds"])
        c = colors.get(p["verdict"], "#7f7f7f")
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{c}"><title>{escape(p["label"])}: '
                   f'{escape(p["verdict"])}</title></circle>'
                   f'<text x="{x + 7:.1f}" y="{y + 4:.1f}" font-weight="bold">{escape(p["name"])}</text>')
    out.append("</svg>")
    return "\n".join(out)
