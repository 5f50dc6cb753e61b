"""`localinfer devices`: the device profiles fit, plan and report use, and this machine."""

from __future__ import annotations

import argparse
import json
import sys

from gguf_tools.text import safe_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME", help="show one profile with every fact and its source")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _row(p) -> dict:
    return {
        "name": p.name, "display_name": p.display_name, "kind": p.kind, "unified": p.unified,
        "memory_bytes": p.memory_bytes, "reserve": p.reserve, "reserve_bytes": p.reserve_bytes,
        "usable_bytes": p.usable_bytes, "working_set_cap_bytes": p.working_set_cap_bytes,
        "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s, "bf16_flops": p.bf16_flops,
        "link_name": p.link_name, "link_bytes_per_s": p.link_bytes_per_s, "power_w": p.power_w,
        "host_memory_bytes": p.host_memory_bytes, "cpu_features": list(p.cpu_features), "host": p.host,
        "decode_mbu": dict(p.decode_mbu), "prefill_mfu": dict(p.prefill_mfu),
        "fp16_flops": p.fp16_flops, "int8_ops": p.int8_ops, "llamacpp_speed": _kernels(p),
        "sources": dict(p.sources), "origin": p.origin,
    }


def _kernels(p) -> dict | None:
    """llama.cpp's speed-model coefficients on this device and what calibrated them (devices/kernels.py)."""
    from localinfer.devices.kernels import coefficients

    c = coefficients(p)
    if c is None:
        return None
    return {"backend": c.backend, "coefficients": c.origin, "token_us": c.token_s * 1e6, "layer_us": c.layer_s * 1e6,
            "ubatch_layer_us": c.ubatch_layer_s * 1e6, "act_passes": c.act_passes, "decode_bw": dict(c.decode_bw),
            "prefill": dict(c.prefill), "peaks": dict(c.peaks),
            "error": {t: dict(v) for t, v in c.error.items()}, "calibrated_on": list(c.calibrated_on),
            "this_device_calibrated": p.name in c.calibrated_on, "sources": dict(c.sources)}


def _host_text(p) -> str:
    """The host a split's RAM side is judged and timed on (profiles/hosts/, localinfer.devices.hosts)."""
    from localinfer.devices.hosts import host_for
    from localinfer.units import fmt_bytes

    h = host_for(p)
    if h is None:
        return "—"
    if h.unified:
        return "the device's own memory (unified)"
    return (f"{h.name}: {fmt_bytes(h.memory_bytes)} RAM, {h.bandwidth_bytes_per_s / 1e9:,.1f} GB/s, {h.cores} cores"
            + (" (bandwidth not probed: a conservative default)" if h.origin == "detected" else ""))


def run(args: argparse.Namespace) -> int:
    from localinfer.devices.profiles import all_devices, get_device, user_profile_dirs

    devices = [get_device(args.name)] if args.name else all_devices()
    if args.json:
        json.dump([_row(p) for p in devices], sys.stdout, indent=1)
        print()
        return 0
    if args.name:
        print(_detail(devices[0]))
        return 0
    print(_table(devices))
    dirs = ", ".join(str(d) for d in user_profile_dirs())
    print(f"\nusable = memory − reserve (see `localinfer devices NAME`); add your own profile as a TOML file in\n"
          f"{dirs} (schema: localinfer/profiles/README.md)")
    return 0


def _table(devices) -> str:
    from localinfer.units import GB, GiB

    head = f"{'name':<16}{'kind':<6}{'usable':>10}{'bandwidth':>11}{'BF16':>8}{'link':>10}{'power':>7}  about"
    lines = [head, "-" * 100]
    for p in devices:
        bw = f"{p.bandwidth_bytes_per_s / GB:,.0f} GB/s" if p.bandwidth_bytes_per_s else "—"
        fl = f"{p.bf16_flops / 1e12:,.0f} T" if p.bf16_flops else "—"
        link = "unified" if p.unified and p.kind != "cpu" else (f"{p.link_bytes_per_s / GB:,.0f} GB/s"
                                                                if p.link_bytes_per_s else "—")
        pw = f"{p.power_w:.0f} W" if p.power_w else "—"
        desc = safe_text(p.display_name, None)
        line = (f"{safe_text(p.name, None)[:15]:<16}{p.kind:<6}{p.usable_bytes / GiB:>6.1f} GiB"
                f"{bw:>11}{fl:>8}{link:>10}{pw:>7}  ")
        room = 100 - len(line)
        lines.append(line + (desc if len(desc) <= room else desc[: room - 1] + "…"))
    return "\n".join(lines)


def _detail(p) -> str:
    from localinfer.units import fmt_bytes

    rows = [("name", p.name), ("display name", p.display_name), ("kind", p.kind), ("unified memory", p.unified),
            ("memory", f"{fmt_bytes(p.memory_bytes)} ({p.memory_bytes:,} B)"),
            ("reserve", f"{p.reserve} = {fmt_bytes(p.reserve_bytes)}"),
            ("working-set cap", fmt_bytes(p.working_set_cap_bytes) if p.working_set_cap_bytes else "—"),
            ("usable", f"{fmt_bytes(p.usable_bytes)} ({p.usable_bytes:,} B)"),
            ("bandwidth", f"{p.bandwidth_bytes_per_s / 1e9:,.1f} GB/s" if p.bandwidth_bytes_per_s else "—"),
            ("dense BF16 peak", f"{p.bf16_flops / 1e12:,.1f} TFLOP/s" if p.bf16_flops else "—"),
            ("host link", f"{p.link_name}, {p.link_bytes_per_s / 1e9:,.0f} GB/s per direction"
             if p.link_bytes_per_s else (p.link_name or "—")),
            ("power", f"{p.power_w:.0f} W" if p.power_w else "—"),
            ("host memory", fmt_bytes(p.host_memory_bytes) if p.host_memory_bytes else "—"),
            ("CPU features", ", ".join(p.cpu_features) or "—"),
            ("host profile", _host_text(p)),
            ("dense FP16 peak", f"{p.fp16_flops / 1e12:,.1f} TFLOP/s" if p.fp16_flops else "—"),
            ("dense INT8 peak", f"{p.int8_ops / 1e12:,.1f} TOP/s" if p.int8_ops else "—"),
            ("decode MBU", ", ".join(f"b={b}: {v:.0%}" for b, v in p.decode_mbu) or "—"),
            ("prefill MFU", ", ".join(f"b={b}: {v:.0%}" for b, v in p.prefill_mfu) or "—"),
            ("from", p.origin)]
    out = [f"{k:<17}{safe_text(v, None)}" for k, v in rows]
    k = _kernels(p)
    if k:
        bands = "; ".join(f"{t} " + ", ".join(f"{c} ±{v:.0%}" for c, v in b.items()) for t, b in k["error"].items())
        out.append(f"{'llama.cpp speed':<17}{k['backend']} kernels ({k['coefficients']}): {k['token_us']:.0f} µs a "
                   f"token + {k['layer_us']:.1f} µs a layer; bandwidth shares "
                   + ", ".join(f"{t} {v:.0%}" for t, v in sorted(k["decode_bw"].items())))
        out.append(f"{'':<17}calibrated on {', '.join(k['calibrated_on']) or 'nothing'}"
                   f" ({'this device among them' if k['this_device_calibrated'] else 'not this device'})"
                   + (f"; 90th-percentile error by size class: {bands}" if bands else ""))
    if p.sources:
        out.append("sources:")
        out += [f"  {k:<15}{safe_text(v, None)}" for k, v in p.sources.items()]
    return "\n".join(out)
