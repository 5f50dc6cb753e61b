"""The fit verdicts rendered: the JSON document of ``localinfer fit --json`` and the 100-column text."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from gguf_tools.text import safe_text
from localinfer.plan.fit import ESTIMATE
from localinfer.units import GiB, MiB, fmt_bytes, fmt_duration
from localinfer.model.kv import snapshot_bytes

WIDTH = 100


def fit_json(spec, req, results) -> dict:
    """The document ``fit --json`` prints: the model, the request, and each device's verdict with every term."""
    from localinfer.model.kv import attention_layers, kv_bytes_per_token, recurrent_state_bytes

    return {
        "model": {"path": spec.path, "name": spec.name, "arch": spec.arch, "n_layers": spec.n_layers,
                  "rules": spec.rules, "rules_source": spec.rules_source,
                  "attention_layers": len(attention_layers(spec)), "recurrent_layers": len(spec.recurrent_layers),
                  "nextn_layers_skipped": spec.n_layer_nextn, "skipped_bytes": spec.skipped_bytes,
                  "weight_bytes": spec.weight_bytes, "file_size": spec.file_size, "n_ctx_train": spec.n_ctx_train,
                  "kv_bytes_per_token": kv_bytes_per_token(spec, req.type_k, req.type_v),
                  "kv_bytes_per_token_formula": (
                      "Σ layers row_bytes(type_k, n_head_kv·head_dim_k) + row_bytes(type_v, n_head_kv·head_dim_v)"
                      if spec.rules in ("attention", "generic") else
                      f"Σ cache layers row_bytes(type_k, K values per cell) + row_bytes(type_v, V values per cell) "
                      f"({spec.rules} rules: {spec.rules_source})"),
                  "recurrent_state_bytes_per_sequence": recurrent_state_bytes(spec, 1),
                  "snapshot_bytes": snapshot_bytes(spec),
                  "missing": list(spec.missing)},
        "request": dict(req.__dict__),
        "devices": [r.to_dict() for r in results],
    }


def _g(n: int | None) -> str:
    if n is None:
        return "—"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def _ctx(n: int | None) -> str:
    if not n:
        return "—"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Recommended:
    """What ``fit`` recommends on one device beside the verdict: the host, a MoE placement, the plan's speed."""

    host: object | None            # localinfer.devices.hosts.HostProfile
    host_bytes: int                # the request's host part
    moe: object | None             # localinfer.plan.moe_fit.MoePlan
    speed: dict | None             # of the recommended plan
    changed: bool                  # the plan is not the request as given
    judged: bool = True            # the verdict and the -ngl search checked the host part against its RAM

    def to_dict(self) -> dict:
        h = self.host
        host = None if h is None else {**h.to_dict(), "host_bytes": self.host_bytes,
                                        "fits": h.unified or self.host_bytes <= h.usable_bytes, "judged": self.judged}
        return {"host": host, "moe_plan": None if self.moe is None else self.moe.to_dict(), "plan_speed": self.speed}


def _host_line(rec: Recommended, device) -> str | None:
    h = rec.host
    if h is None or h.unified or device.kind == "cpu":
        return None
    return (f"host {h.name}: {fmt_bytes(rec.host_bytes)} of {fmt_bytes(h.usable_bytes)} usable RAM, "
            f"{h.bandwidth_bytes_per_s / 1e9:.1f} GB/s, {h.cores} cores" + (f" ({h.source('bandwidth')})"
                                                                            if h.origin == "detected" else ""))


def render_text(spec, req, results, speeds: dict | None = None, plans: dict | None = None) -> str:
    """The fit report as text that reads at 100 columns."""
    fa = {True: "on", False: "off", None: "auto"}[req.flash_attn]
    head = (f"{safe_text(spec.name, None)}  ({spec.arch}, {layers_text(spec)}, {spec.weight_bytes / GiB:.2f} GiB of weights)\n"
            f"request: {req.n_ctx} tokens × {req.n_seq} sequence(s), KV {req.type_k}/{req.type_v}, "
            f"flash attention {fa}, backend {req.backend}"
            + (f", {spec.swa_kind} window {spec.sliding_window} "
               + ("at full size (--swa-full)" if req.swa_full else "cached for window + ubatch (--swa-full: full size)")
               if spec.has_swa else ""))
    kv_head = "KV+state" if spec.has_recurrent else "KV"
    cols = f"{'device':<22}{'usable':>10}{'weights':>11}{kv_head:>10}{'compute':>10}{'left':>11}  {'fits':<5}{'max ctx':>8}{'max par':>8}"
    lines = [head, "", cols, "-" * len(cols)]
    for r in results:
        bd = r.breakdown
        pool = None if bd.unified else "device"
        name = safe_text(r.device.name, None)[:21 - len(_mark(r))] + _mark(r)
        w, kv, cb, left = (bd.sum("weights", pool, resident=True), bd.sum("kv", pool) + bd.sum("state", pool),
                           bd.sum("compute", pool) + bd.sum("output", pool), r.free_bytes) if r.supported else (None,) * 4
        lines.append(f"{name:<22}{_g(r.usable_bytes):>10}{_g(w):>11}{_g(kv):>10}{_g(cb):>10}{_g(left):>11}  "
                     f"{'yes' if r.fits else 'NO':<5}{_ctx(r.max_ctx):>8}{(str(r.max_parallel) if r.max_parallel else '—'):>8}")
    lines.append("")
    for r in results:
        lines.append(f"{safe_text(r.device.name, None)}: {safe_text(r.device.display_name, None)}"
                     + (f" — {r.source}" if r.source != ESTIMATE else ""))
        lines.extend(_wrap(r.reason, "  "))
        rec = (plans or {}).get(r.device.name)
        if rec is not None and _host_line(rec, r.device):
            lines.extend(_wrap(_host_line(rec, r.device), "  "))
        from localinfer.plan.fit import mapped_note

        note = mapped_note(r.breakdown) if r.supported else None
        if note:
            lines.extend(_wrap(note, "  "))
        if len({(o.needed, o.mapped) for o in r.load_options}) > 1:     # only when the load mode matters
            est = " (localinfer's estimate)" if r.source != ESTIMATE else ""
            lines.extend(_wrap(f"load options{est}: " + options_text(r.load_options), "  "))
        if not r.fits:
            if r.suggestions:
                lines.extend(_wrap("would fit with: " + "; ".join(r.suggestions), "  "))
            elif r.offload is None and r.supported:
                lines.append("  nothing fits: not even the weights")
        if r.offload is not None:
            lines.extend(_wrap(f"keep {r.offload.gpu_layers} of {spec.n_layers + 1} layers (the output layer "
                               "counts as one) on the accelerator "
                               f"(-ngl {r.offload.gpu_layers}); the host holds {_g(r.offload.host_bytes)} "
                               "(layers left behind, embeddings, output buffer)", "  "))
        if spec.has_recurrent and r.supported:
            lines.extend(_wrap(f"recurrent state: {_g(bd_state := r.breakdown.state)} for {req.n_seq} sequence(s) "
                               f"({_g(bd_state // max(req.n_seq, 1))} each, whatever the context), beside KV "
                               f"{_g(r.breakdown.kv)} in {len(_attn(spec))} attention layers; serve saves it for "
                               f"prefix hits as snapshots of {_g(snapshot_bytes(spec))} each in host memory", "  "))
        if r.kv_type and r.kv_type != req.type_k:
            lines.append(f"  KV type that fits at this context: {r.kv_type}")
        moe = rec.moe if rec is not None else None
        if moe is not None:
            lines.extend(_wrap(f"experts in host RAM: {moe.flags()} — {moe.why}", "  "))
        sp = rec.speed if rec is not None else (speeds or {}).get(r.device.name)
        if sp and (r.fits or r.offload is not None or moe is not None):
            lines.extend(_wrap(f"speed (predicted, 1 request, {_ctx(req.n_ctx)} context): prefill "
                               f"{sp['prefill_tok_s']:,.0f} tok/s{_band(sp, 'prefill_error')} (TTFT "
                               f"{fmt_duration(sp['ttft_s'])}), decode {sp['decode_tok_s']:,.0f} tok/s"
                               f"{_band(sp, 'decode_error')} ({sp['decode_bound']}-bound; {_speed_basis(sp)})"
                               + ("; if all weights were on the accelerator" if r.offload is not None and rec is None
                                  else "; of the plan above" if rec is not None and rec.changed else ""),
                               "  "))
        for note in r.breakdown.notes + r.warnings:
            lines.extend(_wrap("note: " + note, "  "))
        if moe is not None:
            lines.extend(_wrap(f"llama-server -m {safe_text(spec.path, None)} -c {req.llama_n_ctx} "
                               f"-np {req.n_seq} {moe.flags()}", "  $ ", "      "))
        elif r.command and (r.fits or r.offload is not None):
            lines.extend(_wrap(r.command, "  $ ", "      "))
        lines.append("")
    return "\n".join(lines).rstrip()


def _band(sp: dict, key: str) -> str:
    e = sp.get(key)
    return f" ±{e:.0%}" if e else ""


def _speed_basis(sp: dict) -> str:
    """What the speed figure stands on: llama.cpp's kernel model and its calibration, or the roofline."""
    cal = sp.get("speed_calibration")
    if not cal:
        return "roofline × the profile's efficiencies, no per-kernel overheads, so small models run slower"
    fixed = sp.get("decode_fixed_s")
    share = f"fixed time {fmt_duration(fixed)} a token; " if fixed else ""
    where = ("this device's published llama-bench figures" if cal["this_device_calibrated"]
             else f"{cal['backend']} devices' published llama-bench figures, not this one's")
    return f"{share}llama.cpp {cal['backend']} kernels fitted to {where}; ± the 90th-percentile error there"


def _mark(r) -> str:
    """The table's mark on a row whose numbers are not the estimate's (llama.cpp's dry run)."""
    return " (dry run)" if r.source != ESTIMATE else ""


def _attn(spec) -> list[int]:
    from localinfer.model.kv import attention_layers

    return attention_layers(spec)


def layers_text(spec) -> str:
    """``48 layers (12 attention, 36 recurrent)``, ``61 layers, MLA latent 512+64``, ``+1 NextN skipped``."""
    out = f"{spec.n_layers} layers"
    if spec.has_recurrent:
        out += f" ({len(_attn(spec))} attention, {len(spec.recurrent_layers)} recurrent)"
    if spec.mla is not None and spec.rules == "mla":
        out += f", MLA latent {spec.mla.kv_lora_rank}+{spec.mla.n_rot}"
    if spec.swa_kind == "chunked":
        out += f", chunked attention {spec.sliding_window}"
    if spec.n_layer_nextn:
        out += f", +{spec.n_layer_nextn} NextN skipped"
    return out


def options_text(options) -> str:
    """Each load mode's resident (and mapped, peak) bytes, the cheapest named."""
    parts = []
    for o in options:
        extra = [f"mapped {_g(o.mapped)}"] if o.mapped != o.resident else []
        if o.load_peak > o.resident:
            extra.append(f"{_g(o.load_peak)} while loading")
        parts.append(f"{o.label}{' (as asked)' if o.current else ''} {_g(o.resident)} resident"
                     + (f" ({', '.join(extra)})" if extra else ""))
    best = min(options, key=lambda o: (o.needed, not o.current))
    return "; ".join(parts) + f". Least memory: {best.label}" + (" (as asked)" if best.current else "")


def _wrap(text: str, first: str, rest: str | None = None) -> list[str]:
    return textwrap.wrap(safe_text(text, None), WIDTH, initial_indent=first, subsequent_indent=rest or first,
                         break_on_hyphens=False, break_long_words=True)
