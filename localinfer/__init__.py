"""localinfer: plan and run GGUF language models on the machines people own.

    import localinfer
    localinfer.fit(model, device="h200", ctx=8192)        # FitResult: fits, reason, breakdown, max_ctx ...
    engine = localinfer.load(model, ctx=2048, threads=2)  # the same fit check as `localinfer run`
    localinfer.generate(engine, "Hello", max_tokens=32)   # -> str; stream(...) yields chunks
    localinfer.generate_batch(model, prompts, max_tokens=32, parallel=4)   # many requests, one model
    localinfer.default_model()                            # the embedded SmolLM2-135M GGUF

Names are imported on first use, so ``import localinfer`` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "default_model": "localinfer.generation.api",
    "fit": "localinfer.generation.api",
    "load": "localinfer.generation.api",
    "generate": "localinfer.generation.api",
    "stream": "localinfer.generation.api",
    "generate_batch": "localinfer.serve.batch",
    "FitRequest": "localinfer.backends.memory",
    "LoadPlan": "localinfer.backends.engine",
    "SamplingParams": "localinfer.generation.sampling",
    "Runner": "localinfer.generation.runner",
    "register_backend": "localinfer.backends.registry:register",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'localinfer' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
