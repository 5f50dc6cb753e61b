"""A model split across devices and hosts: does each device hold its share, which split would, and how fast.

``fit_split`` asks the backend's memory model (one that declares ``splits``)
for every byte per device under the requested split (llama.cpp's default:
proportional to free memory), checks each device and the host, and answers
the questions that follow: a split that fits when this one does not, and the
fewest of the given devices that hold the model at this context.

``split_speed`` predicts it stage by stage: each device runs its layers at
its profile's roofline (or, calibrated, at a measured single-host rate scaled
by its share of the weights), decode visits the stages one after another,
and every token pays the network: a fixed RPC overhead (:data:`RPC_OVERHEAD_S`), one round trip per remote stage (the client
reads each remote stage's output; RPC sets are one-way) plus the bytes it
moves — graph inputs to every device, the hidden state over each hop (out of
one worker and into the next, both through the client), the logits back from
the last one.  The weights cross the link once, at load.  Weights the host CPU computes (experts sent
there by ``-ot``/``--n-cpu-moe``, layers below ``-ngl``) are one more stage, timed as
:mod:`localinfer.plan.host_speed` times a one-GPU plan's host part: the slower of its RAM and its cores at
decode; at prefill copied over the local GPU's link once per micro-batch (``-ub`` ≥ 32), else computed there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from localinfer.backends.memory import FitRequest
from localinfer.backends.registry import memory_model
from localinfer.backends.split import SplitBreakdown, SplitDevice
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.units import fmt_bytes

F32, I32, I64 = 4, 4, 8
# Per token, once, whenever a stage is remote: the RPC client's and worker's own work (graph messages, thread
# and process wake-ups), beyond round trips and bytes.  benchmarks/multihost.py measures it with a model whose
# compute is ~0: 0.3-0.6 ms on a loaded 2-vCPU VM over loopback (load average 5-13), about the same for one
# and two workers (docs/multihost.md); a calibration's "rpc_overhead_s" replaces it.
RPC_OVERHEAD_S = 0.3e-3


@dataclass(frozen=True)
class StageSpeed:
    device: str
    layers: int
    prefill_s: float
    decode_s: float
    source: str                 # "profile", "calibrated"


@dataclass(frozen=True)
class SplitSpeed:
    context: int
    stages: tuple[StageSpeed, ...]
    link: str | None
    round_trips: int            # per decode token
    token_bytes: int            # bytes over the link per decode token
    network_s: float            # per decode token
    upload_s: float | None      # the weights' one-off trip to the workers
    decode_tok_s: float
    prefill_tok_s: float
    slowest: str
    formula: str

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stages"] = [s.__dict__ for s in self.stages]
        return d


@dataclass(frozen=True)
class SplitFit:
    spec_name: str
    request: FitRequest
    devices: tuple[SplitDevice, ...]
    breakdown: SplitBreakdown
    host_usable: int | None
    fits: bool
    reason: str
    suggestion: SplitBreakdown | None = None        # a split that fits, when the asked one does not
    smallest: tuple[tuple[int, ...], SplitBreakdown] | None = None
    speed: SplitSpeed | None = None
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return {"model": self.spec_name, "request": dict(self.request.__dict__),
                "devices": [d.__dict__ for d in self.devices], "split": self.breakdown.to_dict(),
                "host_usable": self.host_usable, "fits": self.fits, "reason": self.reason,
                "suggestion": None if self.suggestion is None else self.suggestion.to_dict(),
                "smallest_set": None if self.smallest is None else {
                    "devices": [self.devices[i].name for i in self.smallest[0]],
                    "split": self.smallest[1].to_dict()},
                "speed": None if self.speed is None else self.speed.to_dict(), "warnings": list(self.warnings)}


def _splitter(req: FitRequest):
    model = memory_model(req.backend)
    if model is None or not model.splits:
        raise UsageError(f"the {req.backend} backend cannot split a model across devices", flag="--backend",
                         hint="drop --backend: llama.cpp splits layers over RPC workers and GPUs")
    return model


def _reason(sb: SplitBreakdown, host_usable: int | None) -> str:
    over = [f"{d.name} needs {fmt_bytes(d.total)} of {fmt_bytes(d.usable)}" for d in sb.devices if not d.fits]
    if host_usable is not None and sb.host_total > host_usable:
        over.append(f"the host needs {fmt_bytes(sb.host_total)} of {fmt_bytes(host_usable)}")
    if over:
        return "does not fit: " + "; ".join(over)
    most = max(sb.devices, key=lambda d: d.total / max(d.usable, 1))
    return (f"fits on {len(sb.devices)} device(s); fullest is {most.name}: {fmt_bytes(most.total)} of "
            f"{fmt_bytes(most.usable)}")


def fit_split(spec: ModelSpec, devices, req: FitRequest, *, shares=None, host_usable: int | None = None,
              cpu_features: tuple[str, ...] = (), search: bool = True, profiles=None, link=None,
              remote=None, calibration: dict | None = None, host=None) -> SplitFit:
    """The verdict for ``req`` split over ``devices`` (llama.cpp's order: RPC workers, then local GPUs).

    ``profiles`` (one per device, or None), ``link`` and ``host`` (HostProfile) feed :func:`split_speed`;
    ``remote`` says which devices are across the link (default: all)."""
    model = _splitter(req)
    devices = tuple(devices)
    sb = model.split(spec, devices, req, shares, cpu_features=cpu_features)
    host_ok = host_usable is None or sb.host_total <= host_usable
    fits = sb.fits and host_ok
    suggestion = smallest = None
    if search:
        if not sb.fits:
            suggestion = model.fitting_split(spec, devices, req, cpu_features=cpu_features)
        smallest = model.smallest_set(spec, devices, req, cpu_features=cpu_features)
    warnings = tuple(spec.missing)
    speed = split_speed(spec, sb, req, profiles, link, remote, calibration, host)
    return SplitFit(spec.name, req, devices, sb, host_usable, fits, _reason(sb, host_usable), suggestion, smallest,
                    speed, warnings)


# ---- speed -------------------------------------------------------------------------------

def _token_traffic(spec: ModelSpec, sb: SplitBreakdown, req: FitRequest, remote, tokens: int, rows: int):
    """(bytes over the link, round trips) for one ubatch of ``tokens`` tokens returning ``rows`` logit rows."""
    used = [i for i, d in enumerate(sb.devices) if d.layers or d.output]
    n_kv = -(-sb.n_ctx // max(req.n_seq, 1))
    mask = n_kv * tokens * (2 if req.flash_attn_on else 4)
    inputs = tokens * (I32 + 2 * I64) + mask                     # positions, K/V cell indices, the mask
    hidden = spec.n_embd * tokens * F32
    per_hop = 1 if req.n_gpu_layers < 0 or req.n_gpu_layers > spec.n_layers else 2
    nbytes, trips, prev_remote = 0, 0, False
    for k, i in enumerate(used):
        r = remote[i]
        if r:
            nbytes += inputs + hidden * per_hop                  # graph inputs and the hidden state, in
            trips += 1                                           # its output is read back: one round trip
        if prev_remote:
            nbytes += hidden * per_hop                           # the previous worker's output, out
        prev_remote = r
    if prev_remote:
        nbytes += spec.vocab_size * rows * F32                  # the logits, back from the last worker
    return nbytes, trips


def local_gpu_link(profiles, remote) -> float | None:
    """The link of the first local GPU among the devices (its bytes/s), where llama.cpp's offload_op copies host
    weights; None on RPC workers alone (their backend offloads no op)."""
    gpu = next((p for p, r in zip(profiles or (), remote) if p is not None and not r and p.link_bytes_per_s), None)
    return gpu.link_bytes_per_s if gpu is not None else None


def _host_stage(spec, sb: SplitBreakdown, req: FitRequest, host, profiles, remote):
    """(the host's stage or None, its bytes read and FLOPs a token, which the devices do not do)."""
    from localinfer.plan.host_speed import HostWork

    if not sb.host_tensors:
        return None, 0, 0
    if host is None:
        raise LookupError("no host profile")
    work = HostWork(spec, sb.host_tensors, host, sb.host_kv / max(sb.n_ctx, 1), local_gpu_link(profiles, remote))
    n = req.n_ctx
    dec, _, _ = work.decode(1, min(n, sb.n_ctx))
    pre = work.prefill(n, req.n_ubatch)
    return StageSpeed(f"host {host.name}", work.layers, pre, dec, "profile"), round(work.weight_bytes(1)), work.flops


def split_speed(spec: ModelSpec, sb: SplitBreakdown, req: FitRequest, profiles=None, link=None, remote=None,
                calibration: dict | None = None, host=None) -> SplitSpeed | None:
    """Batch-1 prefill (a ``req.n_ctx``-token prompt) and decode speed of the split, stage by stage.

    ``calibration`` {"decode_s": s/token, "prefill_tok_s": tok/s} measured on one host stands in for profiles
    (each stage takes its share of the weights of it); else every used device needs a profile with bandwidth
    and FLOP/s.  Weights the host computes need ``host`` (a HostProfile; None: no speed) and profiles."""
    from localinfer.model.cost import model_cost

    remote = list(remote) if remote is not None else [True] * len(sb.devices)
    used = [i for i, d in enumerate(sb.devices) if d.layers or d.output]
    total_w = sum(sb.devices[i].weights for i in used) or 1
    cost = model_cost(spec)
    n = req.n_ctx
    if sb.host_tensors and calibration:
        return None
    try:
        host_stage, host_read, host_flops = _host_stage(spec, sb, req, host, profiles, remote)
    except LookupError:
        return None
    stages = []
    for i in used:
        d = sb.devices[i]
        frac = d.weights / total_w
        if calibration:
            stages.append(StageSpeed(d.name, len(d.layers), frac * n / calibration["prefill_tok_s"],
                                     frac * calibration["decode_s"], "calibrated"))
            continue
        p = profiles[i] if profiles else None
        if p is None or not p.bandwidth_bytes_per_s or not p.bf16_flops:
            return None
        mbu, mfu = p.decode_mbu_at(1) or 0.6, p.prefill_mfu_at(1) or 0.5
        rate = p.bf16_flops * mfu
        kv_read = d.kv * min(n, sb.n_ctx) / max(sb.n_ctx, 1)
        read = frac * (cost.decode_read_bytes(1) - host_read) + kv_read   # routed experts: what a token touches
        dec = max(frac * (cost.token_flops(n) - host_flops) / rate, read / (p.bandwidth_bytes_per_s * mbu))
        pre = max(frac * cost.prefill_flops(n) / rate, d.weights / p.bandwidth_bytes_per_s)
        stages.append(StageSpeed(d.name, len(d.layers), pre, dec, "profile"))
    if not stages:
        return None
    if host_stage is not None:
        if math.isnan(host_stage.prefill_s) or not host_stage.decode_s:
            return None
        stages.append(host_stage)
    ub = max(1, min(req.n_ubatch, n))
    n_ub = -(-n // ub)
    fixed = (calibration or {}).get("rpc_overhead_s", RPC_OVERHEAD_S) if any(remote[i] for i in used) else 0.0
    if link is not None:
        tok_bytes, trips = _token_traffic(spec, sb, req, remote, 1, 1)
        net = link.transfer_s(tok_bytes, trips) + fixed
        ub_bytes, ub_trips = _token_traffic(spec, sb, req, remote, ub, 1)
        pre_net = n_ub * (link.transfer_s(ub_bytes, ub_trips) + fixed)
        upload = link.transfer_s(sum(sb.devices[i].weights for i in used if remote[i]))
    else:
        tok_bytes = trips = 0
        net = pre_net = 0.0
        upload = None
    decode = sum(s.decode_s for s in stages) + net
    seq = sum(s.prefill_s for s in stages)
    slow = max(stages, key=lambda s: s.decode_s)
    if sb.pipeline and n_ub > 1:   # consecutive ubatches of the prompt overlap across stages
        worst = max(s.prefill_s for s in stages) / n_ub
        seq = (n_ub - 1) * worst + seq / n_ub
    prefill = seq + pre_net
    return SplitSpeed(n, tuple(stages), None if link is None else link.name, trips, tok_bytes, net, upload,
                      1.0 / decode, n / prefill, slow.device,
                      "decode = Σ stages (max(F_i/(P·MFU), (D_w·W_i/W + KV_i)/(β·MBU))) + RPC overhead + "
                      "round trips × RTT + bytes/bandwidth; prefill = Σ stages (overlapped across ubatches with pipeline "
                      "parallelism) + per-ubatch traffic")


def parse_shares(text: str | None) -> tuple[float, ...] | None:
    """``--tensor-split 3,1`` (UsageError naming the flag)."""
    if text is None:
        return None
    try:
        shares = tuple(float(x) for x in text.replace("/", ",").split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--tensor-split {text!r}: give numbers like 3,1", flag="--tensor-split") from None
    if not shares or any(not 0 <= s < float("inf") for s in shares) or not any(shares):
        raise UsageError(f"--tensor-split {text!r}: shares must be >= 0 and not all 0", flag="--tensor-split")
    return shares
