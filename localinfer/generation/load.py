"""From a model and load options to a checked, loaded engine: what ``run``, ``chat``, ``bench`` and
``localinfer.load`` share.

``load_plan`` turns options into a :class:`~localinfer.backends.engine.LoadPlan`
checked against the model (context within what it was trained for, sizes in
range); ``check_fit`` refuses a plan that does not fit on this machine, naming
the flags that would; ``load`` does both and loads the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from localinfer.backends.engine import Engine, LoadPlan
from localinfer.errors import DoesNotFitError, UnsupportedModelError, UsageError

PLAN_DEFAULTS = {f.name: f.default for f in fields(LoadPlan)}
MAX_CTX = 1 << 24
MAX_BATCH = 1 << 16
MAX_GPU_LAYERS = (1 << 31) - 1
_FLASH = {None: None, "auto": None, "on": True, "off": False, True: True, False: False}


@dataclass(frozen=True)
class Loaded:
    """What ``open_model`` read: the file, its header facts, and the backend name."""

    path: Path
    spec: object      # localinfer.model.spec.ModelSpec
    backend: str


def open_model(model: str | Path | None = None, backend: str | None = None) -> Loaded:
    """Resolve MODEL (None: the embedded default), read its header (only), and canonicalise the backend name."""
    from gguf_tools.split import read_model_header
    from localinfer.backends.registry import DEFAULT_BACKEND, canonical
    from localinfer.model.sources import resolve_model
    from localinfer.model.spec import ModelSpec

    path = resolve_model(None if model is None else str(model))
    if path.is_dir():
        raise UsageError(f"{path} is a directory; pass a .gguf file", flag="MODEL")
    spec = ModelSpec.from_gguf(read_model_header(path)).require_weights()
    return Loaded(path, spec, canonical(backend or DEFAULT_BACKEND))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one); threads are capped at it."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def load_plan(path, spec, *, ctx: int | None = None, force: bool = False, flash_attn=None, type_k: str | None = None,
              type_v: str | None = None, n_gpu_layers: int | None = None, n_threads: int | None = None,
              n_batch: int | None = None, n_ubatch: int | None = None, **overrides) -> LoadPlan:
    """A LoadPlan from load options, checked against the model.  Options left None keep LoadPlan's defaults;
    ``ctx`` None takes the model's trained context, at most LoadPlan's default."""
    if ctx is not None and not 0 < ctx <= MAX_CTX:
        raise UsageError(f"--ctx {ctx} is not a usable context length", flag="--ctx", hint=f"use 1..{MAX_CTX}")
    train = spec.n_ctx_train or PLAN_DEFAULTS["n_ctx"]
    if ctx is None:
        ctx = min(train, PLAN_DEFAULTS["n_ctx"])
    elif ctx > train and not force:
        raise UsageError(f"--ctx {ctx} is longer than the {train} tokens the model was trained on", flag="--ctx",
                         hint=f"use --ctx {train} or less (or --force to try anyway)")
    if flash_attn not in _FLASH:
        raise UsageError(f"flash attention {flash_attn!r}: use on, off or auto", flag="--flash-attn")
    given = {"n_ctx": ctx, "flash_attn": _FLASH[flash_attn]}
    for k, v in (("type_k", type_k), ("type_v", type_v), ("n_gpu_layers", n_gpu_layers), ("n_threads", n_threads),
                 ("n_batch", n_batch)):
        if v is not None:
            given[k] = v
    if n_threads is not None and not 0 < n_threads <= 1024:
        raise UsageError(f"--threads {n_threads} is out of range", flag="--threads", hint="use 1..1024")
    if n_threads is not None and n_threads > usable_cores():
        given["n_threads"] = usable_cores()  # more threads than cores only thrash (1001 on 2 cores: 0.1 tok/s)
    if n_gpu_layers is not None and n_gpu_layers > MAX_GPU_LAYERS:  # llama.cpp takes an int32: 2^32 would be 0
        raise UsageError(f"--gpu-layers {n_gpu_layers} is out of range", flag="--gpu-layers",
                         hint="use -1 for every layer, or a count up to the model's layers")
    for v, flag in ((n_batch, "--batch"), (n_ubatch, "--ubatch")):
        if v is not None and not 0 < v <= MAX_BATCH:
            raise UsageError(f"{flag} {v} is out of range", flag=flag, hint=f"use 1..{MAX_BATCH}")
    if n_ubatch is not None:
        given["n_ubatch"] = n_ubatch
        given["n_batch"] = max(given.get("n_batch", PLAN_DEFAULTS["n_batch"]), n_ubatch)
    elif "n_batch" in given:
        given["n_ubatch"] = min(given["n_batch"], PLAN_DEFAULTS["n_ubatch"])
    given.update(overrides)
    if force:
        given["options"] = {**given.get("options", {}), "force": True}    # engines' own checks (mlx working set)
    return LoadPlan(model_path=str(path), **given)


def check_fit(spec, plan: LoadPlan, backend: str, force: bool = False):
    """The fit verdict for ``plan`` on this machine; DoesNotFitError (hint: the flags that fit) unless ``force``.

    None when the backend registered no memory model (nothing to check against).
    """
    from localinfer.backends.registry import memory_model
    from localinfer.plan.fit import check_load

    if memory_model(backend) is None:
        return None
    result = check_load(spec, plan, device=None, backend=backend)
    if not result.supported:     # the backend cannot run this model at all: no flag of the plan's would help
        hint = None if "--backend" in result.reason else "use --backend llama.cpp"
        raise UnsupportedModelError(result.reason, hint=hint,
                                    arch=spec.arch, backend=backend)
    if result.fits or force:
        return result
    hint = ("flags that fit: " + "; ".join(result.suggestions) + " (or --force)") if result.suggestions \
        else "use a smaller --ctx, a quantized KV cache (-ctk q8_0 -ctv q8_0), or --force"
    raise DoesNotFitError(result.reason, needed=result.needed, available=result.available, hint=hint)


def load(model: str | Path | None = None, *, backend: str | None = None, force: bool = False, **options) -> Engine:
    """Open, plan, check and load: an engine ready for ``localinfer.generation`` (close it, or use ``with``)."""
    from localinfer.backends.registry import load_engine

    opened = open_model(model, backend)
    plan = load_plan(opened.path, opened.spec, force=force, **options)
    check_fit(opened.spec, plan, opened.backend, force)
    return load_engine(plan, opened.backend)
