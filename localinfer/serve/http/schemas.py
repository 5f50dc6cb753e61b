"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked field by field.

Every check raises :class:`~.errors.APIError` 400 with ``param`` set to the
field (``messages[2].content``) and a one-line message giving the value's
type or the allowed range.  Ranges are OpenAI's API reference's
(temperature 0–2, penalties −2–2, top_logprobs 0–20, completions logprobs 0–5,
at most 4 stop strings); sampling fields left out keep
:class:`~localinfer.generation.sampling.SamplingParams`' defaults (llama.cpp's).
Structured output and tools (``response_format``, ``regex``, ``choice``,
``grammar``, llama-server's ``json_schema``, ``tools``, ``tool_choice``) are checked in :mod:`.structured`.
Fields that would change the meaning of a reply and are not implemented
(functions, suffix, best_of, and llama-server's own sampling and output fields
such as ``n_probs`` or ``mirostat``, unless given their
neutral value) are refused rather than ignored; other unknown fields are
ignored, as vLLM does.  ``/v1/completions`` takes a list of prompts (one choice
per prompt and ``n``), ``echo`` and ``logit_bias``; llama-server's ``n_predict``
stands for ``max_tokens``; ``model`` may be left out (the loaded model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from localinfer.generation.sampling import MAX_SEED, SamplingParams
from localinfer.serve.http.errors import bad
from localinfer.serve.http.structured import Structure, parse_structure, tool_message

MAX_N = 16
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_DEADLINE_MS = 24 * 3600 * 1000
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
UNSUPPORTED = ("functions", "function_call", "suffix", "best_of", "audio", "modalities", "prediction")
# llama-server's request fields that change the reply and that this server does not implement: refused unless
# given their neutral value (the value that leaves the reply as without the field); the fields that only tune
# these (mirostat_tau, dry_base, xtc_threshold...) do nothing alone and are ignored.  (grammar, in llguidance's
# Lark dialect or llama.cpp's GBNF, and json_schema are structured.py's.)
LLAMA_SERVER_ONLY = {"n_probs": (0,), "post_sampling_probs": (False,),
                     "mirostat": (0,), "typical_p": (1, 1.0),
                     "tfs_z": (1, 1.0), "top_n_sigma": (-1, -1.0), "xtc_probability": (0, 0.0),
                     "dry_multiplier": (0, 0.0), "dynatemp_range": (0, 0.0),
                     "penalty_last_n": (64,), "repeat_last_n": (64,), "penalize_nl": (False,),
                     "n_keep": (0,), "n_discard": (), "samplers": (), "lora": ([],), "id_slot": (-1,),
                     "n_indent": (0,), "t_max_predict_ms": (0,), "image_data": ([],), "return_tokens": (False,),
                     "min_keep": (0,), "cache_prompt": (True,), "n_cmpl": (1,), "chat_template_kwargs": ({},),
                     "reasoning_format": (), "grammar_lazy": (False,), "grammar_triggers": ([],),
                     "preserved_tokens": ([],)}
MAX_PROMPTS = 64
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request: what to generate and how to answer."""

    chat: bool
    model: str
    messages: tuple[dict, ...] = ()                 # chat: [{"role", "content": str}]
    prompt: str | tuple[int, ...] = ""              # completions: text or token ids (the first of prompts)
    prompts: tuple = ()                             # completions: every prompt (one or more)
    echo: bool = False                              # completions: the prompt's text before each choice's
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100)
    max_tokens: int | None = None                   # None: until the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None                     # top alternatives per token; None: no logprobs
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    deadline_ms: float | None = None
    structure: Structure | None = None              # grammar or tools (structured.py)


def parse(body, *, chat: bool, deadline_header: str | None = None) -> GenerationSpec:
    """A GenerationSpec from a decoded JSON body (any JSON value), or APIError 400."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {_kind(body)}")
    for name in UNSUPPORTED:
        v = body.get(name)
        if v is None or v is False or v == {} or v == [] or v == 1 and name == "best_of" or v == "none":
            continue
        raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
    for name, neutral in LLAMA_SERVER_ONLY.items():
        if name in body and body[name] is not None and not any(body[name] == v for v in neutral):
            raise bad(name, f"{name} is a llama-server field this server does not implement; leave it out",
                      code="unsupported_parameter")
    model = body.get("model")
    model = "" if model is None else model      # optional (or null), as llama-server and vLLM have it
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, got {_kind(model)}")
    kw: dict = {"chat": chat, "model": model}
    if chat:
        kw["messages"] = _messages(body.get("messages"))
    else:
        kw["prompts"] = _prompts(body.get("prompt"))
        kw["prompt"] = kw["prompts"][0]
    if _bool(body, "echo"):
        if chat:
            raise bad("echo", "echo is a /v1/completions field; leave it out of chat requests")
        kw["echo"] = True
    kw["logit_bias"] = _logit_bias(body.get("logit_bias"))
    mt = _int(body, "max_completion_tokens", 1, 1 << 24) if chat else None
    kw["max_tokens"] = mt if mt is not None else _int(body, "max_tokens", 1, 1 << 24)
    if kw["max_tokens"] is None and body.get("n_predict") not in (None, -1):
        kw["max_tokens"] = _int(body, "n_predict", 1, 1 << 24)
    kw["sampling"] = _sampling(body)
    kw["stop"] = _stop(body.get("stop"))
    kw["presence_penalty"] = _float(body, "presence_penalty", -2.0, 2.0) or 0.0
    kw["frequency_penalty"] = _float(body, "frequency_penalty", -2.0, 2.0) or 0.0
    kw["logprobs"] = _logprobs(body, chat)
    kw["n"] = _int(body, "n", 1, MAX_N) or 1
    kw["stream"] = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", f"stream_options must be an object, got {_kind(opts)}")
        kw["include_usage"] = bool(_bool(opts, "include_usage", "stream_options.include_usage"))
    kw["ignore_eos"] = bool(_bool(body, "ignore_eos"))
    kw["deadline_ms"] = _deadline(body, deadline_header)
    kw["structure"] = parse_structure(body)
    if kw["structure"] is not None and kw["structure"].tools and not chat:
        raise bad("tools", "tools are for /v1/chat/completions")
    return GenerationSpec(**kw)


# ---- fields --------------------------------------------------------------------
def _messages(v) -> tuple[dict, ...]:
    if not isinstance(v, list) or not v:
        raise bad("messages", f"messages must be a non-empty array, got {_kind(v)}")
    if len(v) > MAX_MESSAGES:
        raise bad("messages", f"messages has {len(v)} entries; the limit is {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of system, user, assistant, tool, got "
                                       f"{_short(role)}")
        extra = tool_message(m, where, role)
        out.append({"role": ROLES[role], "content": _content(m.get("content"), f"{where}.content",
                                                             "assistant" if extra.get("tool_calls") else role),
                    **extra})
    return tuple(out)


def _content(v, where: str, role: str) -> str:
    if isinstance(v, str):
        return v
    if v is None and role == "assistant":
        return ""
    if not isinstance(v, list):
        raise bad(where, f"{where} must be a string or an array of text parts, got {_kind(v)}")
    parts = []
    for j, p in enumerate(v):
        if not isinstance(p, dict) or p.get("type") != "text":
            kind = p.get("type") if isinstance(p, dict) else _kind(p)
            raise bad(f"{where}[{j}]", f"{where}[{j}] must be a text part {{type: text, text}}, got {_short(kind)}")
        if not isinstance(p.get("text"), str):
            raise bad(f"{where}[{j}].text", f"{where}[{j}].text must be a string, got {_kind(p.get('text'))}")
        parts.append(p["text"])
    return "".join(parts)


def _prompts(v) -> tuple:
    """One prompt (text or token ids) or a list of them: each a non-empty string or array of token ids."""
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        if len(v) > MAX_PROMPTS:
            raise bad("prompt", f"prompt holds {len(v)} prompts; the limit is {MAX_PROMPTS}")
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(v))
    return (_prompt(v, "prompt"),)


def _prompt(v, where: str) -> str | tuple[int, ...]:
    if isinstance(v, str):
        if not v:
            raise bad("prompt", f"{where} is empty")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return tuple(v)
    raise bad("prompt", f"{where} must be a non-empty string or an array of token ids, got {_kind(v)}")


def _logit_bias(v) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (or llama-server's [[id, bias], ...]), each bias in -100..100."""
    if v is None or v == {} or v == []:
        return ()
    items = v.items() if isinstance(v, dict) else v if isinstance(v, list) else None
    if items is None:
        raise bad("logit_bias", f"logit_bias must be an object of token id -> bias, got {_kind(v)}")
    out = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise bad("logit_bias", f"logit_bias entries must be [token id, bias], got {_kind(item)}")
        k, b = item
        try:
            t = int(k) if isinstance(k, (str, int)) and not isinstance(k, bool) else None
        except ValueError:
            t = None
        if t is None or t < 0:
            raise bad("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {_short(k)}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad("logit_bias", f"logit_bias[{t}] must be a number in -100..100, got {_kind(b)}")
        out.append((t, float(b)))
    if len(out) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"logit_bias has {len(out)} entries; the limit is {MAX_LOGIT_BIAS}")
    return tuple(out)


def _sampling(body) -> SamplingParams:
    given = {}
    t = _float(body, "temperature", 0.0, 2.0)
    if t is not None:
        given["temperature"] = t
    p = _float(body, "top_p", 0.0, 1.0)
    if p is not None:
        if p == 0.0:
            raise bad("top_p", "top_p must be in (0, 1], got 0")
        given["top_p"] = p
    k = _int(body, "top_k", -1, 1 << 24)
    if k is not None:
        given["top_k"] = max(k, 0)                  # -1 (vLLM) and 0 both switch it off
    m = _float(body, "min_p", 0.0, 1.0)
    if m is not None:
        given["min_p"] = m
    r = _float(body, "repetition_penalty", 0.0, 100.0)
    if r is not None:
        if r == 0.0:
            raise bad("repetition_penalty", "repetition_penalty must be in (0, 100], got 0")
        given["repeat_penalty"] = r
    s = _int(body, "seed", 0, MAX_SEED)
    if s is not None:
        given["seed"] = s
    return SamplingParams(**given)


def _stop(v) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop must be a string or an array of strings, got {_kind(v)}")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"stop has {len(stops)} strings; the limit is {MAX_STOPS}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters")
    return tuple(s for s in stops if s)


def _logprobs(body, chat: bool) -> int | None:
    if chat:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, 20)
        if top is not None and not on:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if on else None
    return _int(body, "logprobs", 0, 5)


def _deadline(body, header: str | None) -> float | None:
    v = _float(body, "deadline_ms", 0.0, MAX_DEADLINE_MS)
    if header is not None:
        try:
            h = float(header)
        except ValueError:
            raise bad("x-localinfer-deadline-ms", f"the x-localinfer-deadline-ms header must be a number of "
                                                  f"milliseconds, got {_short(header)}") from None
        if not 0 < h <= MAX_DEADLINE_MS:
            raise bad("x-localinfer-deadline-ms", f"x-localinfer-deadline-ms must be in (0, {MAX_DEADLINE_MS}], "
                                                  f"got {h:g}")
        v = h if v is None else min(v, h)
    if v is not None and v <= 0:
        raise bad("deadline_ms", f"deadline_ms must be positive, got {v:g}")
    return v


# ---- typed getters -------------------------------------------------------------
def _int(d: dict, name: str, lo: int, hi: int, where: str | None = None) -> int | None:
    v, where = d.get(name), where or name
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(where, f"{where} must be an integer, got {_kind(v)}")
    if not lo <= v <= hi:
        raise bad(where, f"{where} must be between {lo} and {hi}, got {v}")
    return v


def _float(d: dict, name: str, lo: float, hi: float) -> float | None:
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a finite number, got {_kind(v)}")
    if not lo <= v <= hi:
        raise bad(name, f"{name} must be between {lo:g} and {hi:g}, got {v:g}")
    return float(v)


def _bool(d: dict, name: str, where: str | None = None) -> bool | None:
    v = d.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(where or name, f"{where or name} must be true or false, got {_kind(v)}")
    return v


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {v!r}" if not isinstance(v, float) or math.isfinite(v) else "a non-finite number"
    if isinstance(v, str):
        return f"the string {_short(v)}"
    return {dict: "an object", list: "an array"}.get(type(v), type(v).__name__)


def _short(v) -> str:
    s = repr(v)
    s = "".join(c if c.isprintable() else "?" for c in s)
    return s if len(s) <= 40 else s[:37] + "..."
