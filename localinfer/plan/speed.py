"""Speed model: how long prefill and decode take for one model on one device.

A decode step makes one token for each of ``b`` requests at context ``L``::

    T_step ≈ max(b·F / (P·MFU),  (D_w + b·L·k) / (β·MBU))

and a prefill takes its FLOPs (matrices plus attention pairs) over ``P·MFU``,
never less than one read of the weights per micro-batch.  ``P``, ``β`` and the
efficiencies come from the device profile; measurements (``Calibration``)
replace the efficiencies when given.  Request figures follow docs/speed.md:
TTFT = queue + prefill, request time = TTFT + Σ ITL, and the GPU-seconds a
request holds is t = L/r_P + (G − 1)/r_D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from localinfer.errors import UsageError
from localinfer.model.cost import DEFAULT_UBATCH, ModelCost, rounds_needed
from localinfer.plan.calibration import Calibration
from localinfer.units import ceil_div

# Used only when a device profile gives no efficiency of its own.
FALLBACK_DECODE_MBU = 0.6
FALLBACK_PREFILL_MFU = 0.5


@dataclass(frozen=True)
class Estimate:
    """A predicted duration with its two roofline terms and where it came from."""

    seconds: float
    compute_s: float
    memory_s: float
    flops: int
    bytes: int
    source: str            # "measured", "calibrated", "profile", "kernels" (llama.cpp's model) or "unknown"

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class Workload:
    """``requests`` requests that arrive together, each ``input_tokens`` in and ``output_tokens`` out.

    The first ``shared_prefix`` input tokens are identical across requests;
    ``prefix_cached`` says their KV is already held when the requests arrive.
    """

    requests: int = 1
    input_tokens: int = 512
    output_tokens: int = 128
    shared_prefix: int = 0
    prefix_cached: bool = True
    queue_s: float = 0.0
    deadline_s: float | None = None

    def __post_init__(self):
        for name, flag in (("requests", "--requests"), ("input_tokens", "--input"), ("output_tokens", "--output")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > 1 << 31:
                raise UsageError(f"{flag} must be a whole number from 1 to 2^31, got {v!r}", flag=flag)
        if not 0 <= self.shared_prefix <= self.input_tokens:
            raise UsageError(f"--shared-prefix {self.shared_prefix} must be between 0 and --input {self.input_tokens}",
                             flag="--shared-prefix")
        if self.deadline_s is not None and not (self.deadline_s > 0 and math.isfinite(self.deadline_s)):
            raise UsageError(f"--deadline must be a positive number of seconds, got {self.deadline_s}", flag="--deadline")
        if not (self.queue_s >= 0 and math.isfinite(self.queue_s)):
            raise UsageError("queue time must be >= 0 seconds", flag="--queue")

    @property
    def cached_tokens(self) -> int:
        return self.shared_prefix if self.prefix_cached else 0

    @property
    def decode_context(self) -> int:
        """Mean context over the decode steps: L + G/2."""
        return self.input_tokens + self.output_tokens // 2


@dataclass(frozen=True)
class RequestTiming:
    """Predicted timeline of a batch of requests (all figures per request unless named)."""

    workload: Workload
    prefill: Estimate          # the whole batch's prefill
    step: Estimate             # one decode round of the batch
    steps: int                 # rounds after the first token
    tokens_per_step: float     # tokens each request gains per round (E[N] with drafting)

    @property
    def ttft_s(self) -> float:
        return self.workload.queue_s + self.prefill.seconds

    @property
    def itl_s(self) -> float:
        return self.step.seconds / self.tokens_per_step

    @property
    def decode_s(self) -> float:
        return self.steps * self.step.seconds

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second one request sees while decoding."""
        return self.tokens_per_step / self.step.seconds

    @property
    def aggregate_tok_s(self) -> float:
        return self.workload.requests * self.decode_tok_s

    @property
    def prefill_tok_s(self) -> float:
        """r_P: new input tokens per second of prefill."""
        w = self.workload
        return w.requests * (w.input_tokens - w.cached_tokens) / self.prefill.seconds

    @property
    def gpu_s_per_request(self) -> float:
        """Accelerator time one request holds: prefill and decode shares of the batch's time."""
        return (self.prefill.seconds + self.decode_s) / self.workload.requests

    @property
    def on_time(self) -> bool | None:
        d = self.workload.deadline_s
        return None if d is None else self.total_s <= d


def gpu_seconds(new_tokens: int, prefill_rate: float, output_tokens: int, decode_rate: float) -> float:
    """t = L / r_P + (G − 1) / r_D: r_P in new tokens/s, r_D in decode calls/s (batch / step time)."""
    return new_tokens / prefill_rate + (output_tokens - 1) / decode_rate


def energy_per_good(batch_seconds: float, good_results: int, power_w: float) -> float:
    """Joules per good result: the batch holds the device (at ``power_w``) for ``batch_seconds``."""
    return math.inf if good_results <= 0 else batch_seconds * power_w / good_results


def amdahl(total_s: float, part_s: float, speedup: float) -> float:
    """Task time after speeding one part up: (total − part) + part / s."""
    return total_s - part_s + part_s / speedup


def compression_gain(bytes_saved: float, effective_bandwidth: float, convert_s: float) -> float:
    """ΔT = ΔD/β − T_c: positive when reading fewer bytes beats the format conversion."""
    return bytes_saved / effective_bandwidth - convert_s


class SpeedModel:
    """Predicts prefill and decode times of one model (``ModelCost``) on one device profile."""

    def __init__(self, cost: ModelCost, device, calibration: Calibration | None = None,
                 ubatch: int = DEFAULT_UBATCH, kernels=None):
        self.cost = cost
        self.device = device
        self.ubatch = ubatch
        self.kernels = kernels        # llama.cpp's kernel model (plan/kernel_speed.py): replaces the roofline
        self.peak_flops = float(getattr(device, "bf16_flops", None) or 0) or None
        self.bandwidth = float(getattr(device, "bandwidth_bytes_per_s", None) or 0) or None
        self.calibration = calibration.bind(cost) if calibration else None

    def mbu(self, batch: int = 1) -> float:
        """Decode bandwidth efficiency at ``batch`` (the profile's table, else a fallback)."""
        at = getattr(self.device, "decode_mbu_at", None)
        return (at(batch) if at else None) or FALLBACK_DECODE_MBU

    def mfu(self, batch: int = 1) -> float:
        """Prefill compute efficiency at ``batch`` (the profile's table, else a fallback)."""
        at = getattr(self.device, "prefill_mfu_at", None)
        return (at(batch) if at else None) or FALLBACK_PREFILL_MFU

    def effective_bandwidth(self, batch: int = 1) -> float | None:
        """β·MBU: what a bandwidth-bound decode step achieves on this device."""
        return self.bandwidth * self.mbu(batch) if self.bandwidth else None

    def _compute_rate(self, batch: int, new: int, cached: int) -> tuple[float | None, str]:
        cal = self.calibration
        if cal is not None and cal.has_prefill:
            return cal.prefill_rate(batch, new, cached)
        if self.peak_flops is None:
            return None, "unknown"
        return self.peak_flops * self.mfu(batch), "profile"

    def decode_step(self, batch: int = 1, context: int = 1, kv="f16", rows: int = 1,
                    shared_prefix: int = 0) -> Estimate:
        """One decode round: ``batch`` requests at ``context``, each verifying ``rows`` positions."""
        cal = self.calibration
        if self.kernels is not None and not (cal is not None and cal.has_decode):
            t = self.kernels.decode(batch, context, kv, rows)
            return Estimate(t.seconds, t.compute_s, t.memory_s, t.flops, t.bytes, "kernels")
        nbytes = self.cost.step_bytes(batch, context, kv)
        flops = batch * rows * self.cost.token_flops(context)
        rate, csrc = self._compute_rate(batch, rows, context)
        compute_s = flops / rate if rate else 0.0
        cal = self.calibration
        if cal is not None and cal.has_decode:
            memory_s, source = cal.decode_seconds(nbytes, shared_prefix > 0, kv)
        elif self.bandwidth:
            memory_s, source = nbytes / self.effective_bandwidth(batch), "profile"
        else:
            memory_s, source = math.nan, "unknown"
        if compute_s > memory_s:
            source = csrc
        seconds = math.nan if math.isnan(memory_s) else max(compute_s, memory_s)
        return Estimate(seconds, compute_s, memory_s, flops, nbytes, source)

    def prefill(self, batch: int, new: int, cached: int = 0) -> Estimate:
        """Prefill of ``batch`` sequences, each ``new`` tokens after ``cached`` ones already in KV."""
        cal = self.calibration
        if self.kernels is not None and not (cal is not None and cal.has_prefill):
            t = self.kernels.prefill(batch, new, cached)
            return Estimate(t.seconds, t.compute_s, t.memory_s, t.flops, t.bytes, "kernels")
        flops = batch * self.cost.prefill_flops(new, cached)
        calls = ceil_div(batch * new, self.ubatch)
        nbytes = calls * self.cost.decode_read_bytes(min(self.ubatch, batch * new))
        rate, source = self._compute_rate(batch, new, cached)
        compute_s = flops / rate if rate else math.nan
        memory_s = nbytes / self.bandwidth if self.bandwidth else 0.0   # a floor: MFU covers the rest
        if source in ("measured", "calibrated"):
            return Estimate(compute_s, compute_s, memory_s, flops, nbytes, source)
        seconds = max(compute_s, memory_s) if rate else math.nan
        return Estimate(seconds, compute_s, memory_s, flops, nbytes, source)

    def request(self, workload: Workload, kv="f16", tokens_per_step: float = 1.0, rows: int = 1,
                prefill_factor: float = 1.0, step_extra_s: float = 0.0) -> RequestTiming:
        """Timeline of ``workload`` with KV type ``kv``.

        Speculative decoding enters as ``tokens_per_step`` (E[N]), ``rows`` verified
        positions per request, ``prefill_factor`` (a draft model's extra prefill) and
        ``step_extra_s`` (drafting time per round).
        """
        w = workload
        pre = self.prefill(w.requests, w.input_tokens - w.cached_tokens, w.cached_tokens)
        if prefill_factor != 1.0:
            pre = _scaled(pre, prefill_factor)
        step = self.decode_step(w.requests, w.decode_context, kv, rows=rows, shared_prefix=w.shared_prefix)
        if step_extra_s:
            step = Estimate(step.seconds + step_extra_s, step.compute_s, step.memory_s, step.flops, step.bytes,
                            step.source)
        steps = rounds_needed(w.output_tokens - 1, tokens_per_step)
        return RequestTiming(w, pre, step, steps, tokens_per_step)

    def tokens_per_second(self, context: int, kv="f16") -> tuple[float, float]:
        """(prefill tok/s for a ``context``-token prompt, decode tok/s at ``context``), batch 1."""
        pre = self.prefill(1, context)
        return context / pre.seconds, 1.0 / self.decode_step(1, context, kv).seconds


def _scaled(e: Estimate, factor: float) -> Estimate:
    return Estimate(e.seconds * factor, e.compute_s * factor, e.memory_s * factor,
                    round(e.flops * factor), e.bytes, e.source)


LLAMACPP_FORMULA = ("decode step = t_token + n_layer·t_layer + n_moe·t_moe + Σ_type D_type/(β·e_type) + L·k/(β·e_kv); prefill = "
                    "Σ per micro-batch max(2·N·u/(P_path·m_path), D/(β·e)) + attention/(P_attn·m_attn) + "
                    "n_layer·t_ubatch; batch 1; coefficients per device kind fitted to published llama-bench "
                    "results (docs/speed.md)")


def llamacpp_speed_model(spec, device, calibration: Calibration | None = None,
                         ubatch: int = DEFAULT_UBATCH, *, table_first: bool = True) -> SpeedModel:
    """The speed model ``plan`` and ``report`` use for ``spec`` on ``device``: measurements (``calibration``) first;
    then, with ``table_first`` (``plan``), a profile's own measured efficiency table (the chapter's RTX PRO 6000,
    SPEC §8.6: the vLLM serving roofline its worked numbers come from); else llama.cpp's kernel model where the
    device's kind has coefficients (``report``, as ``fit``); else the roofline with fallback efficiencies."""
    from localinfer.model.cost import model_cost
    from localinfer.plan.kernel_speed import kernel_speed

    measured = table_first and bool(getattr(device, "decode_mbu", ()))
    kernels = None if measured else kernel_speed(spec, device, ubatch)
    return SpeedModel(model_cost(spec), device, calibration, ubatch, kernels=kernels)


def predict_speed(spec, device, req) -> dict | None:
    """Batch-1 prefill and decode tok/s at the requested context, from the device profile.

    For llama.cpp, its kernels' model (:mod:`localinfer.plan.kernel_speed`: fixed times, per-type bandwidth
    fractions, per-path peaks) with the error band its calibration supports; elsewhere the roofline with the
    profile's efficiencies.  ``None`` where the profile lacks the bandwidth or peak FLOP/s the speed model
    needs (e.g. this machine's CPU: measure it with ``localinfer bench``), or where the backend's kernels
    are not what the profile's efficiencies describe (only llama.cpp's are).
    """
    from localinfer.backends.registry import memory_model
    from localinfer.model.cost import model_cost
    from localinfer.plan.kernel_speed import kernel_speed

    backend = memory_model(req.backend)
    if not getattr(backend, "speed_modelled", False) or not device.bandwidth_bytes_per_s or not device.bf16_flops:
        return None
    kv = req.type_k if req.type_k == req.type_v else "f16"
    ks = kernel_speed(spec, device, ubatch=req.n_ubatch)
    if ks is not None:
        pre, step = ks.prefill(1, req.n_ctx), ks.decode(1, req.n_ctx, kv)
        out = {"context": req.n_ctx, "prefill_tok_s": req.n_ctx / pre.seconds, "ttft_s": pre.seconds,
               "decode_tok_s": 1.0 / step.seconds, "decode_step_s": step.seconds,
               "decode_bound": "compute" if step.compute_s > step.memory_s else "memory",
               "decode_fixed_s": step.fixed_s, **speed_band(ks), "formula": LLAMACPP_FORMULA}
        return out
    model = SpeedModel(model_cost(spec), device, ubatch=req.n_ubatch)
    prefill = model.prefill(1, req.n_ctx)
    step = model.decode_step(1, req.n_ctx, kv)
    if not prefill.seconds or not step.seconds or math.isnan(prefill.seconds) or math.isnan(step.seconds):
        return None
    return {"context": req.n_ctx, "prefill_tok_s": req.n_ctx / prefill.seconds, "ttft_s": prefill.seconds,
            "decode_tok_s": 1.0 / step.seconds, "decode_step_s": step.seconds,
            "decode_bound": "compute" if step.compute_s > step.memory_s else "memory",
            "formula": "decode step = max(F/(P·MFU), (D_w + L·k)/(β·MBU)); prefill = FLOPs (incl. attention "
                       "pairs c(c+1)/2) / (P·MFU); batch 1, profile efficiencies"}


def speed_band(ks) -> dict:
    """How sure the kernel model is for this device and model: the calibration's 90th-percentile error for
    the model's size class, and what set the coefficients."""
    c = ks.coeff
    n = sum(t.n_elements for t in ks.spec.tensors)
    return {"decode_error": c.error_band("decode", n), "prefill_error": c.error_band("prefill", n),
            "speed_calibration": {"backend": c.backend, "coefficients": c.origin,
                                  "calibrated_on": list(c.calibrated_on),
                                  "this_device_calibrated": ks.device.name in c.calibrated_on}}
