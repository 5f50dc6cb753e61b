"""llama.cpp's ``--fit`` decision (``common/fit.cpp``, ``common_params_fit_impl``) for one device, step by step.

:func:`fit_cpp` replays what llama.cpp does with its dry runs, with any measure of a request's device bytes
standing in for them (localinfer's memory model of a profile, or of a ``worker --mem`` device), so the
decision can be checked against the real ``llama-fit-params`` on the same device.  One device only
(``nd == 1``; the tensor split of several is not ported) and a context the user set (step 2, lowering
``n_ctx``, runs only for ``-c 0``).  The steps, each kept where the device total stays within the target
(free memory − the 1 GiB margin):

1. the request as given: no change when it fits (``<=``);
2. (not ported) a smaller context;
3. "dense-only" layers: ``-ngl`` = layers + 1 and, for a MoE model, the experts of the layers after the first
   on the CPU (fit.cpp counts the output layer as the one full layer, but its patterns start at the first
   layer index after the full ones, so layer 0 keeps its experts); fewer layers by false position when even
   that does not fit;
4. for a MoE model whose dense part fits with every expert on the CPU: experts back front to back (false
   position on the number of full layers), then part of the first layer still on the CPU, each kept only
   when strictly under the target: its ``up`` experts (pattern ``ffn_(gate|gate_up|down).*`` to the CPU),
   then ``up`` and ``gate`` (``ffn_down.*``); when ``up`` does not fit, ``ATTN``: the layer's whole FFN
   (``ffn_(gate|up|gate_up|down).*``: router and shared experts too) goes to the CPU.

The ``-ot`` list is fit.cpp's, one entry per layer; an entry that names no tensor (the layer index after the
last, which fit.cpp's indexing reaches) is kept in :attr:`FitCpp.overrides` as the tool prints it and left out
of :attr:`FitCpp.request`, where llama.cpp ignores it anyway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from localinfer.backends.memory import FitRequest

MARGIN = 1 << 30                       # fit.cpp's default target of free memory per device (-fitt 1024)
# fit.cpp's common_layer_fraction_t: what of a layer stays on the device -> the pattern of what goes to the CPU
FRACTIONS = {"attn": r"ffn_(gate|up|gate_up|down).*", "up": r"ffn_(gate|gate_up|down).*",
             "gate": r"ffn_down.*", "moe": r"ffn_(up|down|gate_up|gate)_(ch|)exps"}
STAYS = {"up": "its up experts stay on the device (with gate too it would not be strictly under the target)",
         "gate": "its up and gate experts stay on the device",
         "attn": "only its attention stays on the device (its up experts do not fit strictly under the target), "
                 "its whole FFN, router included, goes to the CPU"}
ALL_EXPERTS = r"blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps"
PATTERN = re.compile(r"^blk\\\.(\d+)\\\.(.*)$")


@dataclass(frozen=True)
class FitCpp:
    """fit.cpp's answer: its flags, where the experts went and the device total it measured for them."""

    request: FitRequest                    # the flags as localinfer applies them
    n_gpu_layers: int                      # -ngl as the tool prints it (-1: unchanged)
    overrides: tuple[tuple[str, str], ...]  # -ot as the tool prints it, in its order
    n_full: int                            # layers whose experts stay on the device (fit.cpp's n_full)
    on_host: int                           # layers whose routed experts are all in host memory
    partial: str | None                    # the first partial layer's fraction: "up", "gate", "attn" or None
    device_bytes: int
    steps: tuple[str, ...] = ()            # what it tried, for the reasons printed

    @property
    def changed(self) -> bool:
        return self.n_gpu_layers != -1 or bool(self.overrides)


@dataclass
class _Ngl:
    n_layer: int = 0
    n_part: int = 0
    overflow: str = "moe"

    @property
    def n_full(self) -> int:
        return self.n_layer - self.n_part


def layer_overrides(n_layer_total: int, s: _Ngl) -> list[tuple[int, str]]:
    """(layer, fraction) of each -ot entry, as fit.cpp's ``set_ngl_tensor_split_tbo`` writes them."""
    il0 = n_layer_total + 1 - s.n_layer + s.n_full
    return [(il, s.overflow if il == il0 else "moe") for il in range(il0, il0 + s.n_part)]


def parse_override(pattern: str) -> tuple[int, str] | None:
    """(layer, fraction) of one of fit.cpp's -ot patterns, None for another pattern."""
    m = PATTERN.match(pattern)
    if not m:
        return None
    frac = next((k for k, v in FRACTIONS.items() if v == m.group(2)), None)
    return None if frac is None else (int(m.group(1)), frac)


def merged(entries: list[tuple[int, str]]) -> tuple[tuple[str, str], ...]:
    """The same tensors as fit.cpp's one entry per layer, one entry per fraction (the layers as an alternation)."""
    by: dict[str, list[int]] = {}
    for il, f in entries:
        by.setdefault(f, []).append(il)
    return tuple((rf"blk\.{ls[0]}\.{FRACTIONS[f]}" if len(ls) == 1 else
                  rf"blk\.({'|'.join(map(str, ls))})\.{FRACTIONS[f]}", "CPU") for f, ls in by.items())


def state_request(spec, req: FitRequest, n_layer: int, n_part: int, overflow: str = "moe") -> FitRequest:
    """The request fit.cpp measures for ``n_layer`` layers on the device of which ``n_part`` overflow (the first
    of them by ``overflow``), the -ot entries that name a tensor merged per fraction."""
    names = [t.name for t in spec.tensors]
    live = [(il, f) for il, f in layer_overrides(spec.n_layers, _Ngl(n_layer, n_part, overflow))
            if any(re.search(rf"blk\.{il}\.{FRACTIONS[f]}", x) for x in names)]
    return replace(req, n_gpu_layers=n_layer, override_tensor=merged(live), cpu_moe=False, n_cpu_moe=0)


def _search(cur, lo: int, high, hi: int, target: int, mem, span, move):
    """fit.cpp's search between a plan that fits (``cur``, ``lo`` bytes) and one that does not (``high``, ``hi``):
    ``move(cur, k)`` steps k units towards ``high`` (``_step``'s false position) while ``span(high, cur)`` > 1."""
    while span(high, cur) > 1:
        test = move(cur, _step(span(high, cur), lo, hi, target))
        m = mem(test)
        if m <= target:
            cur, lo = test, m
        else:
            high, hi = test, m
    return cur, lo


def _step(delta: int, lo_mem: int, hi_mem: int, target: int) -> int:
    """fit.cpp's false-position step: int64 division truncated toward zero, cast to uint32, in [1, delta-1]."""
    num, den = delta * (target - lo_mem), hi_mem - lo_mem
    q = abs(num) // abs(den) if den else 0
    q = (-q if (num < 0) != (den < 0) else q) % (1 << 32)
    return min(max(q, 1), delta - 1)


def fit_cpp(spec, req: FitRequest, device_bytes: Callable[[FitRequest], int], target: int) -> FitCpp | None:
    """llama.cpp ``--fit``'s choice for ``req`` on one device (see the module).

    ``device_bytes(request)``: the device's weights + KV + compute for a request; ``target``: its free memory
    minus the margin.  None where fit.cpp gives up (``-ngl`` or ``-ot`` set by the user)."""
    n = spec.n_layers
    names = [t.name for t in spec.tensors]
    moe = any("_exps." in x for x in names)
    steps: list[str] = []

    def entries(s: _Ngl) -> list[tuple[str, str]]:
        return [(rf"blk\.{il}\.{FRACTIONS[f]}", "CPU") for il, f in layer_overrides(n, s)]

    def request(s: _Ngl) -> FitRequest:
        return state_request(spec, req, s.n_layer, s.n_part, s.overflow)

    def mem(s: _Ngl) -> int:
        return device_bytes(request(s))

    def answer(s: _Ngl | None, used: int) -> FitCpp:
        if s is None:
            return FitCpp(req, -1, (), n, 0, None, used, tuple(steps))
        ents = layer_overrides(n, s)
        real = [(il, f) for il, f in ents if il < n]
        exps = {int(x.split(".")[1]) for x in names if x.startswith("blk.") and "_exps." in x}
        on_host = sum(1 for il, f in real if f in ("moe", "attn") and il in exps)
        partial = s.overflow if s.n_part and s.overflow != "moe" else None
        return FitCpp(request(s), s.n_layer, tuple(entries(s)), s.n_full, on_host, partial, used, tuple(steps))

    if req.n_gpu_layers != -1 or req.override_tensor or req.cpu_moe or req.n_cpu_moe:
        return None
    used = device_bytes(req)
    if used <= target:
        steps.append("the request fits as it is")
        return answer(None, used)
    surplus = 0
    if moe:
        surplus = target - device_bytes(replace(req, override_tensor=((ALL_EXPERTS, "CPU"),)))

    # step 3: dense-only layers (a MoE model's experts on the CPU), back to front
    cur = _Ngl()
    lo = mem(cur)
    high = _Ngl(n + 1, n if moe else 0)
    hi = mem(high)
    if hi > target:
        cur, lo = _search(cur, lo, high, hi, target, mem, lambda h, c: h.n_layer - c.n_layer,
                          lambda c, k: _Ngl(c.n_layer + k, c.n_part + ((k - 1 if c.n_part == 0 else k) if moe else 0)))
        steps.append(f"dense-only layers: {cur.n_layer} of {n + 1} fit")
    else:
        cur, lo = high, hi
        steps.append("every layer's dense part fits with the experts on the CPU")
    if not moe or surplus <= 0:
        return answer(cur, lo)

    # step 4: experts back on the device, front to back, then part of one more layer
    high = _Ngl(cur.n_layer, 0)
    hi = mem(high)
    if hi > target:
        cur, lo = _search(cur, lo, high, hi, target, mem, lambda h, c: h.n_full - c.n_full,
                          lambda c, k: _Ngl(c.n_layer, c.n_part - min(k, c.n_part)))
    else:
        cur, lo = high, hi
    steps.append(f"{cur.n_full} layers' experts on the device")
    if cur.n_layer > 1:                 # part of one more layer: up, then gate too; else only its attention
        up = replace(cur, overflow="up")
        m = mem(up)
        if m < target:
            cur, lo = up, m
            gate = replace(cur, overflow="gate")
            m = mem(gate)
            if m < target:
                cur, lo = gate, m
        else:
            attn = replace(cur, overflow="attn")
            m = mem(attn)
            if m < target:
                cur, lo = attn, m
        if cur.n_part and cur.overflow != "moe":
            steps.append(f"layer {layer_overrides(n, cur)[0][0]}: {STAYS[cur.overflow]}")
    return answer(cur, lo)
