"""The chapter's example instance, built as inputs: a skeleton model, a device profile, measurements.

Everything here is an *input* the chapter states (architecture, device facts,
measured step times and efficiencies); the figures it derives from them are
what the tests compare against.
"""

from __future__ import annotations

from pathlib import Path

from gguf_tools.skeleton import write_skeleton
from localinfer.devices.profiles import get_device
from localinfer.model.cost import model_cost
from localinfer.model.spec import ModelSpec
from localinfer.plan.calibration import Calibration, DecodeSample, PrefillSample
from localinfer.plan.speed import SpeedModel

# SPEC §8.6, experiment 8-1 (vLLM, RTX PRO 6000, 2K in, 256 out, no sharing): measured decode steps
MEASURED_STEP = {1: 26.26e-3, 4: 26.62e-3, 16: 27.44e-3, 64: 29.63e-3}
MEASURED_PREFILL_MFU = {1: 0.62, 4: 0.61, 16: 0.61, 64: 0.58}
# The shared-prefix condition measured in the same experiment: 8K in (6K cached), batch 16
SHARED_PREFILL_S = 2.04
SHARED_STEP_S = 27.35e-3


def spec(tmp: Path, preset: str = "qwen3-8b", type: str | None = None) -> ModelSpec:
    path = Path(tmp) / f"{preset}-{type or 'default'}.gguf"
    if not path.exists():
        write_skeleton(preset, path, type=type)
    return ModelSpec.from_gguf(path)


def rtx():
    return get_device("rtx-pro-6000")


def calibration(s: ModelSpec, shared: bool = True) -> Calibration:
    """Experiment 8-1's table (and, with ``shared``, its shared-prefix measurement) as samples."""
    cost, dev = model_cost(s), rtx()
    decode = [DecodeSample(b, 2048, t) for b, t in MEASURED_STEP.items()]
    prefill = [PrefillSample.from_mfu(cost, dev.bf16_flops, b, 2048, m) for b, m in MEASURED_PREFILL_MFU.items()]
    if shared:
        decode.append(DecodeSample.from_request(16, 8192, 256, SHARED_STEP_S, shared_prefix=6144))
        prefill.append(PrefillSample(16, 2048, SHARED_PREFILL_S, cached_tokens=6144))
    return Calibration(tuple(decode), tuple(prefill), source="SPEC §8.6 experiment 8-1")


def speed(s: ModelSpec, calibrated: bool = True) -> SpeedModel:
    return SpeedModel(model_cost(s), rtx(), calibration(s) if calibrated else None)


def close(value: float, printed: float, rel: float = 0.005) -> bool:
    """Within the chapter's printed precision (about 0.5%)."""
    return abs(value - printed) <= rel * abs(printed)
