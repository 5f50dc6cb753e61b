"""Steps 3 and 4 of llama.cpp's ``--fit`` (``common/fit.cpp``) over ``nd`` devices, and its ``-ot`` patterns.

A state is one :class:`Ngl` per device (fit.cpp's ``ngl_t``: ``n_layer`` layers of which ``n_part`` overflow)
and one buffer per device for its first partial layer (``overflow_bufts``: the CPU, or the next device once
part of a layer went there).  :func:`layout` is fit.cpp's ``set_ngl_tensor_split_tbo``: ``-ngl`` is the sum
of the devices' layers, ``-ts`` their counts, and the ``-ot`` entries start at layer ``n_layer + 1 − ngl``
plus each device's full layers.  ``mem(states, bufts)`` is the measure: device bytes of each device.

3. :func:`fill_dense`: back to front, each device (the last first) gets the most "dense-only" layers (a MoE
   model's experts on the CPU; the last device's first layer is the output layer, always full) that keep it
   within its target, by false position;
4. :func:`fill_full`, for a MoE model whose dense part fits with every expert on the CPU: front to back,
   each device converts the dense-only layers at the back (its own, then the later devices') into full layers
   while it stays within its target, then tries part of one more layer (``up``, then ``up`` and ``gate``;
   else only its attention), kept only strictly under the target of the device and of the next one (to
   which the part of a device that is not the last overflows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

CPU = "CPU"
# fit.cpp's common_layer_fraction_t: what of a layer stays on the device -> the pattern of what goes elsewhere
FRACTIONS = {"attn": r"ffn_(gate|up|gate_up|down).*", "up": r"ffn_(gate|gate_up|down).*",
             "gate": r"ffn_down.*", "moe": r"ffn_(up|down|gate_up|gate)_(ch|)exps"}
ALL_EXPERTS = r"blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps"
PATTERN = re.compile(r"^blk\\\.(\d+)\\\.(.*)$")


class GivesUp(Exception):
    """fit.cpp throws ``common_params_fit_exception`` (the tool exits 1): no flags."""


@dataclass(frozen=True)
class Ngl:
    n_layer: int = 0
    n_part: int = 0
    overflow: str = "moe"

    @property
    def n_full(self) -> int:
        return self.n_layer - self.n_part


def layout(n_layer_total: int, states, bufts) -> list[tuple[int, str, str]]:
    """(layer, fraction, buffer) of each -ot entry, in fit.cpp's order (``set_ngl_tensor_split_tbo``)."""
    if any(s.n_part < 0 or s.n_part > s.n_layer for s in states):
        # a uint32 n_part wrapped: fit.cpp's loop runs past llama_max_tensor_buft_overrides() and throws
        raise GivesUp("llama_max_tensor_buft_overrides() is insufficient for model")
    il0 = n_layer_total + 1 - sum(s.n_layer for s in states)
    out = []
    for s, b in zip(states, bufts):
        il0 += s.n_full
        out += [(il, s.overflow if il == il0 else "moe", b if il == il0 else CPU) for il in range(il0, il0 + s.n_part)]
        il0 += s.n_part
    return out


def layer_overrides(n_layer_total: int, s: Ngl) -> list[tuple[int, str]]:
    """(layer, fraction) of each -ot entry of one device."""
    return [(il, f) for il, f, _ in layout(n_layer_total, [s], [CPU])]


def entries(ents) -> tuple[tuple[str, str], ...]:
    """fit.cpp's -ot list, one (pattern, buffer) per layer, as the tool prints it."""
    return tuple((rf"blk\.{il}\.{FRACTIONS[f]}", b) for il, f, b in ents)


def parse_override(pattern: str) -> tuple[int, str] | None:
    """(layer, fraction) of one of fit.cpp's -ot patterns, None for another pattern."""
    m = PATTERN.match(pattern)
    if not m:
        return None
    frac = next((k for k, v in FRACTIONS.items() if v == m.group(2)), None)
    return None if frac is None else (int(m.group(1)), frac)


def merged(ents) -> tuple[tuple[str, str], ...]:
    """The same tensors as fit.cpp's one entry per layer, one entry per fraction and buffer (the layers as an
    alternation); ``ents``: (layer, fraction[, buffer]), the buffer CPU when left out."""
    by: dict[tuple[str, str], list[int]] = {}
    for e in ents:
        by.setdefault((e[1], e[2] if len(e) > 2 else CPU), []).append(e[0])
    return tuple((rf"blk\.{ls[0]}\.{FRACTIONS[f]}" if len(ls) == 1 else
                  rf"blk\.({'|'.join(map(str, ls))})\.{FRACTIONS[f]}", b) for (f, b), ls in by.items())


def live(names, ents) -> list:
    """The entries that name a tensor (fit.cpp's indexing reaches the layer after the last; llama.cpp ignores it)."""
    return [e for e in ents if any(re.search(rf"blk\.{e[0]}\.{FRACTIONS[e[1]]}", x) for x in names)]


def _step(delta: int, lo_mem: int, hi_mem: int, target: int) -> int:
    """fit.cpp's false-position step: int64 division truncated toward zero, cast to uint32, in [1, delta-1]."""
    num, den = delta * (target - lo_mem), hi_mem - lo_mem
    q = abs(num) // abs(den) if den else 0
    q = (-q if (num < 0) != (den < 0) else q) % (1 << 32)
    return min(max(q, 1), delta - 1)


def _set(states, i: int, **kw) -> list[Ngl]:
    out = list(states)
    out[i] = replace(out[i], **kw)
    return out


def fill_dense(n_layer_total: int, moe: bool, targets, mem, steps: list[str]):
    """Step 3: (states, bytes per device) with the devices filled back to front with dense-only layers."""
    nd = len(targets)
    bufts = [CPU] * nd
    cur = [Ngl()] * nd
    used = mem(cur, bufts)
    for i in range(nd - 1, -1, -1):
        n_unassigned = n_layer_total + 1 - sum(s.n_layer for s in cur[i + 1:])
        high = _set(cur, i, n_layer=n_unassigned,
                    n_part=(n_unassigned if i < nd - 1 else n_unassigned - 1) if moe else cur[i].n_part)
        if high[i].n_layer <= 0:
            continue
        hi = mem(high, bufts)
        searched = hi[i] > targets[i]
        if searched:
            delta = high[i].n_layer - cur[i].n_layer
            while delta > 1:
                k = _step(delta, used[i], hi[i], targets[i])
                part = cur[i].n_part + ((k - 1 if i == nd - 1 and cur[i].n_part == 0 else k) if moe else 0)
                test = _set(cur, i, n_layer=cur[i].n_layer + k, n_part=part)
                m = mem(test, bufts)
                if m[i] <= targets[i]:
                    cur, used = test, m
                else:
                    high, hi = test, m
                delta = high[i].n_layer - cur[i].n_layer
        else:
            cur, used = high, hi
        if nd > 1:
            steps.append(f"device {i}: {cur[i].n_layer} {'dense-only ' if moe else ''}layers")
        else:                                      # one device: the words fit's reasons have used since issue 41
            steps.append(f"dense-only layers: {cur[i].n_layer} of {n_layer_total + 1} fit" if searched else
                         "every layer's dense part fits with the experts on the CPU")
    return cur, used


def fill_full(n_layer_total: int, targets, names, cur, used, mem, steps: list[str]):
    """Step 4: (states, overflow buffers, bytes per device) with dense-only layers made full, front to back."""
    nd = len(targets)
    bufts = [CPU] * nd
    start = nd                                     # id_dense_start: the first device of the trailing ones with layers
    for i in range(nd - 1, -1, -1):
        if cur[i].n_layer <= 0:
            break
        start = i
    i = 0
    while i <= start < nd:
        high = list(cur)
        for j in range(start, nd):
            move = high[j].n_layer if j < nd - 1 else high[j].n_layer - 1
            high[i] = replace(high[i], n_layer=high[i].n_layer + move)
            high[j] = replace(high[j], n_layer=high[j].n_layer - move, n_part=0)
        start_high = nd - 1
        hi = mem(high, bufts)
        if hi[i] > targets[i]:
            delta = high[i].n_full - cur[i].n_full
            while delta > 1:
                k = _step(delta, used[i], hi[i], targets[i])
                test, st, done = list(cur), start, 0
                while st < nd:
                    c = min(k - done, test[st].n_part)
                    test[st] = replace(test[st], n_layer=test[st].n_layer - c, n_part=test[st].n_part - c)
                    test[i] = replace(test[i], n_layer=test[i].n_layer + c)
                    done += c
                    if test[st].n_part > 0:
                        break
                    st += 1
                m = mem(test, bufts)
                if m[i] <= targets[i]:
                    cur, used, start = test, m, st
                else:
                    high, hi, start_high = test, m, st
                delta = high[i].n_full - cur[i].n_full
        else:
            cur, used, start = high, hi, start_high
        steps.append(f"device {i}: {cur[i].n_full} layers' experts on it" if nd > 1 else
                     f"{cur[i].n_full} layers' experts on the device")
        cur, bufts, used, start = _one_more(n_layer_total, i, start, cur, bufts, used, targets, names, mem, steps)
        i += 1
    return cur, bufts, used


STAYS = {"up": "its up experts stay (with gate too it would not be strictly under the target)",
         "gate": "its up and gate experts stay",
         "attn": "only its attention stays (its up experts do not fit strictly under the target), its whole FFN, "
                 "router included, goes"}
STAYS_ONE = {"up": "its up experts stay on the device (with gate too it would not be strictly under the target)",
             "gate": "its up and gate experts stay on the device",
             "attn": "only its attention stays on the device (its up experts do not fit strictly under the target), "
                     "its whole FFN, router included, goes to the CPU"}


def _one_more(n_layer_total, i, start, cur, bufts, used, targets, names, mem, steps):
    """fit.cpp's "try to fit at least part of one more layer" for device ``i``."""
    nd = len(targets)
    if start >= nd or cur[start].n_layer <= (0 if i < nd - 1 else 1):   # start < nd: fit.cpp reads past the end
        return cur, bufts, used, start
    test = _set(cur, start, n_layer=cur[start].n_layer - 1, n_part=cur[start].n_part - 1)
    test = _set(test, i, n_layer=test[i].n_layer + 1, n_part=test[i].n_part + 1)
    st = start + 1 if test[start].n_part == 0 else start
    bt = list(bufts)
    if i < nd - 1:
        bt[i] = names[i + 1]

    def ok(m) -> bool:
        return m[i] < targets[i] and (i + 1 == nd or m[i + 1] < targets[i + 1])

    kept = None
    for frac in ("up", "gate"):
        test = _set(test, i, overflow=frac)
        m = mem(test, bt)
        if not ok(m):
            break
        cur, bufts, used, start, kept = test, bt, m, st, frac
    if kept is None:
        test = _set(test, i, overflow="attn")
        m = mem(test, bt)
        if ok(m):
            cur, bufts, used, start, kept = test, bt, m, st, "attn"
    if kept is not None and cur[i].n_part:
        il = n_layer_total + 1 - sum(s.n_layer for s in cur[i:]) + cur[i].n_full
        steps.append(f"layer {il}: {STAYS[kept]} to {bufts[i]}" if nd > 1 else f"layer {il}: {STAYS_ONE[kept]}")
    return cur, bufts, used, start
