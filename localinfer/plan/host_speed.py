"""Speed of a plan whose weights are partly in host RAM: experts (``--n-cpu-moe``) or layers (``-ngl``).

Decode, one token at batch 1, is the GPU part and the host part one after the other (a layer's host
experts run on the CPU between its GPU attention and the next layer)::

    T_step = max(F_gpu / (P·MFU), (D − D_host) / (β·MBU))            the GPU: all it keeps, KV included
           + max(D_host / (β_host·MBU_host), F_host / (n_cores·r))   the host: what it keeps, RAM or cores

with ``D`` and ``F`` the all-GPU step's bytes and FLOPs (:meth:`SpeedModel.decode_step`),
``D_host`` the host tensors' bytes one token reads (routed experts: the ``k/n`` share a token
touches; other weights whole; the KV of host layers) and ``F_host`` their FLOPs, computed one thread a
core at ``r`` (:data:`localinfer.devices.hosts.DECODE_FLOPS_PER_CORE`, fitted on published runs: the CPU
kernels dequantise each weight in the dot product, so a host with few cores for its RAM channels is
bound by its cores).  With nothing on the host this is the all-GPU figure exactly.  The device part
carries the kernel model's fixed times; no extra time is added for the device↔host hop per layer.

Prefill, one prompt of ``n_ctx`` tokens in micro-batches of ``-ub``: for micro-batches of 32 tokens or more
llama.cpp's CUDA and Metal backends copy host weights to the device and compute there (the ``offload_op`` rule,
docs/memory.md "MoE experts in host memory"; the scheduler copies only the experts the micro-batch routes to, all of
them for a micro-batch of hundreds of tokens), so the all-GPU prefill plus ``⌈n_ctx/ub⌉ · W_host / link``;
below 32 the host computes its share ``F_host`` at its own rate.  :class:`HostWork` is the one home of these terms.
"""

from __future__ import annotations

import math

from localinfer.model.cost import model_cost
from localinfer.plan.speed import SpeedModel, predict_speed
from localinfer.units import ceil_div

OFFLOAD_MIN_BATCH = 32      # ggml-cuda / ggml-metal: ops on host weights move to the device from this batch on
FORMULA = ("decode step = GPU max(F_gpu/(P·MFU), (D − D_host)/(β·MBU)) + host max(D_host/(β_host·MBU_host), "
           "F_host/(cores·r_core)); D_host = host experts × k/n + other host weights + host layers' KV; "
           "prefill = all-GPU prefill + ⌈n_ctx/ub⌉ × host weights / link (ub ≥ 32), else the host computes its "
           "share; no per-layer fixed time (the speed model has none)")


def host_terms(spec, host_names: frozenset[str]) -> tuple[int, int, int, int]:
    """(bytes a token reads, FLOPs a token needs, bytes held, host layers) of the host tensors."""
    read = flops = held = 0
    layers = set()
    share = (spec.n_expert_used / spec.n_expert) if spec.n_expert else 1.0
    for t in spec.tensors:
        if t.name not in host_names or t.name == "token_embd.weight":
            continue                       # the embeddings are a row lookup, never read whole
        held += t.n_bytes
        expert = "_exps." in t.name
        f = share if expert and spec.n_expert else 1.0
        read += round(t.n_bytes * f)
        if len(t.shape) >= 2:
            flops += round(2 * t.n_elements * f)
        if not expert and t.name.startswith("blk.") and "attn" in t.name:
            layers.add(int(t.name.split(".")[1]))
    return read, flops, held, len(layers)


KERNEL_FORMULA = ("decode step = GPU part (llama.cpp's kernel model over the weights on the device: t_token + "
                  "n_layer·t_layer + Σ D_type/(β·e_type) + KV) + host max(D_host/(β_host·MBU_host), "
                  "F_host/(cores·r_core)); D_host = host experts × k/n + other host weights + host layers' KV; "
                  "prefill = all-GPU prefill + ⌈n_ctx/ub⌉ × host weights / link (ub ≥ 32), else the host "
                  "computes its share")


def _split_prefill(all_gpu_s: float, cost, work: HostWork, req) -> tuple[float, str]:
    """(seconds, rule) of a one-GPU plan's prefill: the all-GPU prefill plus the host weights copied over the link per
    micro-batch (32 tokens or more), else the devices' share and the host computing its own (:class:`HostWork`)."""
    extra = work.prefill(req.n_ctx, req.n_ubatch)
    if work.offloaded(min(req.n_ubatch, req.n_ctx)):
        return all_gpu_s + extra, "host weights copied over the link once per micro-batch"
    share = work.flops / cost.token_flops(req.n_ctx) if cost.token_flops(req.n_ctx) else 0.0
    return all_gpu_s * (1 - share) + extra, "the host computes its share (micro-batch below 32)"


def _work(spec, cost, host, req, host_names: frozenset[str], kv: str, link: float | None) -> "HostWork":
    """The host's tensors of a one-GPU plan: their KV a ``kv`` cache of ``req.n_ctx`` tokens in the host layers."""
    work = HostWork(spec, host_names, host, 0.0, link)
    kv_host = cost.kv_read_bytes(req.n_ctx, kv) * work.layers // max(spec.n_layers, 1)
    work.kv_per_token = kv_host / max(req.n_ctx, 1)
    return work


def _bound(gpu_s: float, host_s: float, host_mem: float, host_comp: float, gpu_bound: str) -> str:
    """What a split's decode step waits on: the host's memory or compute, else the device's ``gpu_bound``."""
    if host_s >= gpu_s:
        return "host memory" if host_mem >= host_comp else "host compute"
    return gpu_bound


def split_speed(spec, device, host, req, host_names: frozenset[str]) -> dict | None:
    """Batch-1 prefill and decode of ``req`` with ``host_names`` in the RAM of ``host`` (see the module)."""
    if not device.bandwidth_bytes_per_s or not device.bf16_flops or host is None:
        return None
    from localinfer.plan.kernel_speed import kernel_speed

    ks = kernel_speed(spec, device, ubatch=req.n_ubatch, exclude=host_names)
    if ks is not None:
        return _kernel_split(spec, ks, host, req, host_names)
    cost = model_cost(spec)
    model = SpeedModel(cost, device, ubatch=req.n_ubatch)
    kv = req.type_k if req.type_k == req.type_v else "f16"
    step = model.decode_step(1, req.n_ctx, kv)
    pre = model.prefill(1, req.n_ctx)
    work = _work(spec, cost, host, req, host_names, kv, device.link_bytes_per_s)
    w_flops, held = work.flops, work.held
    d_host = work.read_bytes(1, req.n_ctx)
    gpu_mem = (step.bytes - d_host) / model.effective_bandwidth(1)
    gpu_comp = step.compute_s * (1 - w_flops / step.flops) if step.flops else 0.0
    host_s, host_mem, host_comp = work.decode(1, req.n_ctx)
    gpu_s = max(gpu_mem, gpu_comp)
    decode_s = gpu_s + host_s
    prefill_s, how = _split_prefill(pre.seconds, cost, work, req)
    if not decode_s or math.isnan(decode_s) or math.isnan(prefill_s):
        return None
    return {"context": req.n_ctx, "prefill_tok_s": req.n_ctx / prefill_s, "ttft_s": prefill_s,
            "decode_tok_s": 1.0 / decode_s, "decode_step_s": decode_s,
            "decode_bound": _bound(gpu_s, host_s, host_mem, host_comp, "compute" if gpu_comp > gpu_mem else "memory"),
            "gpu_s": gpu_s, "host_s": host_s, "host_read_bytes": round(d_host), "host_flops": w_flops,
            "host_weight_bytes": held,
            "host": host.name, "host_bandwidth_bytes_per_s": host.bandwidth_bytes_per_s, "prefill_rule": how,
            "formula": FORMULA}


def plan_speed(spec, device, host, req) -> dict | None:
    """The speed of the plan ``req`` describes: :func:`predict_speed` when every weight is on the device,
    else :func:`split_speed` over the tensors the backend keeps on the host."""
    from localinfer.backends.registry import memory_model

    backend = memory_model(req.backend)
    if not (backend.speed_modelled and backend.offload):
        return predict_speed(spec, device, req)
    on_host = {n for n in backend.host_tensors(spec, device, req) if n != "token_embd.weight"}
    if not on_host:
        return predict_speed(spec, device, req)
    return split_speed(spec, device, host, req, frozenset(on_host))


def _kernel_split(spec, ks, host, req, host_names: frozenset[str]) -> dict | None:
    """:func:`split_speed` with the device part from llama.cpp's kernel model (fixed times included)."""
    from localinfer.plan.speed import speed_band

    cost, device = ks.cost, ks.device
    kv = req.type_k if req.type_k == req.type_v else "f16"
    work = _work(spec, cost, host, req, host_names, kv, device.link_bytes_per_s)
    w_flops, held = work.flops, work.held
    kv_host = work.kv_bytes(req.n_ctx)
    step = ks.decode(1, req.n_ctx, kv)
    # the host layers' KV is read on the host: out of the device's memory term (not out of its fixed or compute time)
    gpu_s = step.fixed_s + max(step.memory_s - kv_host / (device.bandwidth_bytes_per_s * ks.kv_share(kv)),
                               step.compute_s)
    host_s, host_mem, host_comp = work.decode(1, req.n_ctx)
    decode_s = gpu_s + host_s
    pre = ks.prefill(1, req.n_ctx)
    prefill_s, how = _split_prefill(pre.seconds, cost, work, req)
    if not decode_s or math.isnan(decode_s) or math.isnan(prefill_s):
        return None
    return {"context": req.n_ctx, "prefill_tok_s": req.n_ctx / prefill_s, "ttft_s": prefill_s,
            "decode_tok_s": 1.0 / decode_s, "decode_step_s": decode_s,
            "decode_bound": _bound(gpu_s, host_s, host_mem, host_comp, "memory"),
            "gpu_s": gpu_s, "host_s": host_s, "decode_fixed_s": step.fixed_s,
            "host_read_bytes": round(work.read_bytes(1, req.n_ctx)),
            "host_flops": w_flops,
            "host_weight_bytes": held, "host": host.name, "host_bandwidth_bytes_per_s": host.bandwidth_bytes_per_s,
            "prefill_rule": how, **speed_band(ks), "formula": KERNEL_FORMULA}


class HostWork:
    """What the host's tensors cost a call of ``b`` tokens: the one home of llama.cpp's ``offload_op`` rule and the
    host's decode and prefill terms (fit's one-GPU plans, a split's host stage, the planner's batched steps).

    A call of ``b`` tokens reads the host's other weights whole, the share ``1 − (1 − k/n)^b`` of its routed experts
    (each token routes to ``k`` of ``n``, drawn independently: a batch's tokens touch their union) and its layers'
    KV, and computes ``b`` tokens' FLOPs: below ``OFFLOAD_MIN_BATCH`` tokens at the host's matrix-vector rate
    (``decode_flops``: the rate fitted on published batch-1 runs), from there at its batched rate (``effective_flops``,
    never below the other).  From ``OFFLOAD_MIN_BATCH`` tokens on, with a local GPU, llama.cpp's CUDA and Metal
    backends copy the host weights over that GPU's link and compute there (``offload_op``); the scheduler copies only
    the experts the call's tokens use (ggml-backend.cpp, "copying only the experts that are used"), so the copy is
    the weights the call reads; the host layers' KV and their attention stay on the host.
    """

    def __init__(self, spec, host_names: frozenset[str], host, kv_per_token: float = 0.0,
                 link_bytes_per_s: float | None = None):
        read, self.flops, self.held, self.layers = host_terms(spec, host_names)
        self.share = (spec.n_expert_used / spec.n_expert) if spec.n_expert else 1.0
        self.expert = round((self.held - read) / (1 - self.share)) if self.share < 1 else 0
        self.other = self.held - self.expert
        self.host, self.kv_per_token, self.link = host, kv_per_token, link_bytes_per_s

    def offloaded(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens runs the host weights on the GPU (copied over its link)."""
        return bool(self.link) and tokens >= OFFLOAD_MIN_BATCH

    def weight_bytes(self, tokens: int) -> float:
        """Weight bytes a call of ``tokens`` tokens reads (or, offloaded, copies)."""
        return self.other + self.expert * (1.0 - (1.0 - self.share) ** max(tokens, 1))

    def read_bytes(self, tokens: int, kv_tokens: float = 0) -> float:
        """Bytes a call of ``tokens`` tokens reads from host RAM (``kv_tokens``: context tokens of all sequences)."""
        return self.weight_bytes(tokens) + self.kv_bytes(kv_tokens)

    def kv_bytes(self, kv_tokens: float) -> float:
        return self.kv_per_token * kv_tokens

    def rate(self, tokens: int) -> float:
        """FLOP/s the host computes a call of ``tokens`` tokens at (0: unknown)."""
        vec = self.host.decode_flops or 0.0
        if tokens < OFFLOAD_MIN_BATCH and vec:
            return vec
        return max(vec, self.host.effective_flops or 0.0)

    def decode(self, tokens: int, kv_tokens: float = 0) -> tuple[float, float, float]:
        """(seconds, memory seconds, compute seconds) of the host's part of a step of ``tokens`` tokens."""
        kv = self.kv_bytes(kv_tokens) / self.host.effective_bandwidth
        if self.offloaded(tokens):
            copy = self.weight_bytes(tokens) / self.link
            return copy + kv, copy + kv, 0.0
        memory = self.read_bytes(tokens, kv_tokens) / self.host.effective_bandwidth
        rate = self.rate(tokens)
        compute = tokens * self.flops / rate if rate else 0.0
        return max(memory, compute), memory, compute

    def prefill(self, tokens: int, ubatch: int) -> float:
        """Seconds the host weights add to a prefill of ``tokens`` tokens in calls of ``ubatch`` (NaN: no rate)."""
        ub = max(1, min(ubatch, tokens))
        if self.offloaded(ub):
            return ceil_div(tokens, ub) * self.weight_bytes(ub) / self.link
        rate = self.rate(ub)
        return tokens * self.flops / rate if rate else math.nan
