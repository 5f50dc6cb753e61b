"""A split across devices rendered: one row per device (layers, weights, KV, compute, fits), the host, the
verdict, the split that would fit, the fewest devices, and the predicted speed stage by stage."""

from __future__ import annotations

from gguf_tools.text import safe_text
from localinfer.plan.split_fit import over
from localinfer.units import fmt_bytes


def _layers(layers: tuple[int, ...], output: bool) -> str:
    if not layers:
        return "output" if output else "-"
    text = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return text + (" +out" if output else "")


def _table(sb) -> list[str]:
    rows = [(f"  {'device':<34} {'layers':>10} {'weights':>10} {'KV':>10} {'compute':>10} {'total':>10} "
             f"{'usable':>10}  fits")]
    for d in sb.devices:
        rows.append(f"  {safe_text(d.name)[:34]:<34} {_layers(d.layers, d.output):>10} {fmt_bytes(d.weights):>10} "
                    f"{fmt_bytes(d.kv):>10} {fmt_bytes(d.compute):>10} {fmt_bytes(d.total):>10} "
                    f"{fmt_bytes(d.usable):>10}  {'yes' if d.fits else 'NO'}")
    hw = sum(sb.host_weights.values())
    rows.append(f"  {'host CPU (input layer, logits)':<34} {'-':>10} {fmt_bytes(hw):>10} {fmt_bytes(sb.host_kv):>10} "
                f"{fmt_bytes(sb.host_compute):>10} {fmt_bytes(sb.host_total):>10}")
    return rows


def _shares(sb) -> str:
    return ",".join(str(c) for c in sb.counts())


def render_split_text(spec, sf) -> str:
    sb = sf.breakdown
    req = sf.request
    out = [(f"{safe_text(spec.name)}: ctx {req.n_ctx} × {req.n_seq}, KV {req.type_k}/{req.type_v}, "
            f"split across {len(sb.devices)} device(s), layer split {_shares(sb)} "
            f"({'pipeline parallel' if sb.pipeline else 'no pipeline'})")]
    out += _table(sb)
    if sf.host_usable is not None:
        out.append(f"  host usable {fmt_bytes(sf.host_usable)}")
    out.append(sf.reason)
    if sf.suggestion is not None:
        out.append(f"a split that fits: --tensor-split {_shares(sf.suggestion)}")
    elif not sb.fits:
        out.append("no split of these devices fits: try a smaller --ctx or -ctk q8_0 -ctv q8_0")
    if sf.smallest is not None:
        chosen, best = sf.smallest
        names = ", ".join(sf.devices[i].name for i in chosen)
        full = [0] * len(sf.devices)
        for i, c in zip(chosen, best.counts()):
            full[i] = c
        others_remote = all(d.remote for i, d in enumerate(sf.devices) if i not in chosen)
        how = "drop --rpc" if others_remote and not any(sf.devices[i].remote for i in chosen) else \
            f"--tensor-split {','.join(map(str, full))}"
        out.append(f"fewest devices that hold it: {len(chosen)} ({names}; {how})")
    sp = sf.speed
    if sp is not None:
        out.append(f"speed ({sp.stages[0].source}, link {sp.link or 'none given'}): decode {sp.decode_tok_s:.1f} tok/s, "
                   f"prefill {sp.prefill_tok_s:.0f} tok/s at {sp.context} tokens; slowest stage {safe_text(sp.slowest)}")
        for s in sp.stages:
            out.append(f"  stage {safe_text(s.device)[:34]:<34} {s.layers:>3} layers  decode {s.decode_s * 1e3:8.3f} ms/token"
                       f"  prefill {s.prefill_s:8.3f} s")
        if sp.link:
            up = f", weights upload {sp.upload_s:.1f} s once at load" if sp.upload_s else ""
            out.append(f"  network per token: {sp.round_trips} round trip(s) + {fmt_bytes(sp.token_bytes)} = "
                       f"{sp.network_s * 1e3:.3f} ms{up}")
    for n in sb.notes + sf.warnings:
        out.append(f"note: {n}")
    return "\n".join(out)


def _tok_s(p: dict | None, none: str) -> str:
    if p is None:
        return none
    if not p["fits"]:
        return "does not fit"
    return f"{p['speed']['decode_tok_s']:.1f}" if p["speed"] else "-"


def render_split_rows(hosts: str, link: str | None, rows: list[dict], markdown: bool) -> str:
    """One line per model × context × KV type of ``report --split``: the request's verdict, layer split and fullest
    device; the plan ``fit --devices`` recommends and its decode; llama.cpp ``--fit``'s decode."""
    head = ["model", "ctx", "KV", "fits", "split", "fullest device", "plan", "decode tok/s", "--fit tok/s",
            "net ms/token"]
    body = []
    for r in rows:
        devs = r["split"]["devices"]
        full = max(devs, key=lambda d: d["total"] / max(d["usable"], 1))
        plan = r.get("plan")
        sp = plan["speed"] if plan else None
        fix = r["suggestion"]
        verdict = "yes" if r["fits"] else ("with -ts " + ",".join(map(str, fix["counts"])) if fix else "no")
        body.append([safe_text(r["model"]), str(r["ctx"]), r["kv"], verdict,
                     ",".join(map(str, r["split"]["counts"])),
                     f"{safe_text(full['name'])} {100 * full['total'] / max(full['usable'], 1):.0f}%",
                     plan["summary"] if plan else "none fits", _tok_s(plan, "-"),
                     _tok_s(r.get("llamacpp_fit"), "gives up"),
                     f"{sp['network_s'] * 1e3:.2f}" if sp and sp["link"] else "-"])
    title = f"Split over {hosts}" + (f" ({link})" if link else " (no link given: no network cost)")
    if markdown:
        lines = [f"## {safe_text(title)}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [safe_text(title), "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(lines)


def _bytes(p) -> str:
    devs = ", ".join(f"{safe_text(d.name)} {fmt_bytes(d.total)}{'' if d.fits else ' (over)'}"
                     for d in p.breakdown.devices)
    ram = f"; {p.experts_on_host} layers' experts in RAM" if p.experts_on_host else ""
    return f"{devs}; host {fmt_bytes(p.breakdown.host_total)}{'' if p.fits_host else ' (over its RAM)'}{ram}"


def _decode(p) -> str:
    return f"decode {p.speed.decode_tok_s:.1f} tok/s" if p.speed is not None else "decode: no speed"


def _its_plan(p) -> str:
    """--fit's plan (for -c as given, or left out): its bytes, decode, and what it is over if it does not fit."""
    return f"  its plan: {_bytes(p)}; {_decode(p)}" + ("" if p.fits else "; does not fit: " + over(p))


def render_fit_compare(plan, ref, auto=None, *, ctx_given: bool = True, no_ref: str = "--fit gives up") -> str:
    """llama.cpp ``--fit``'s choice over the split's devices beside localinfer's plan (plan.split_fit): flags,
    bytes per device as the load allocates them, predicted decode, and with ``-c`` left out (``auto``) --fit's
    own context."""
    out = []
    same = (plan is not None and ref is not None and ref.fits and plan.by == "localinfer"
            and (plan.request, plan.shares) == (ref.request, ref.shares))
    if ref is None:
        out.append("llama.cpp " + no_ref)
    elif same:
        out.append(f"llama.cpp --fit: {ref.flags()} (the request fits as it is: no change; localinfer's plan too)")
    else:
        out.append(f"llama.cpp --fit: {ref.flags()}")
        out.append(_its_plan(ref))
        if ref.steps:
            out.append("  its steps: " + "; ".join(ref.steps))
    if auto is not None and ref is not None and auto.flags() == ref.flags():
        out.append("llama.cpp --fit with -c left out: the same line")
    elif auto is not None:
        out.append(f"llama.cpp --fit with -c left out (it starts from the train context and its step 2 may lower "
                   f"it): {auto.flags()}")
        out.append(_its_plan(auto))
    elif not ctx_given:
        out.append("llama.cpp --fit with -c left out: gives up here")
    if not ctx_given:
        out.append("note: localinfer's --ctx has a default (4096, or the train context if smaller); llama.cpp's --fit "
                   "lowers the context (its step 2) only when -c is left out, never a -c given")
    if plan is None:
        out.append("localinfer's plan: none fits these devices and this host")
    elif not same:
        out.append(f"localinfer's plan: {plan.flags()}" + (" (--fit's)" if plan.by.endswith("(as --fit)") else ""))
        out.append(f"  {_bytes(plan)}; {_decode(plan)}")
        out.append(f"  why: {plan.why}")
    return "\n".join(out)
