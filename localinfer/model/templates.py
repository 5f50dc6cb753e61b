"""Chat templates from GGUF metadata, rendered in a sandbox with limits.

A GGUF's ``tokenizer.chat_template`` is untrusted code (CVE-2024-34359 ran
code from one).  Templates render in jinja2's ImmutableSandboxedEnvironment
with a wall-clock limit, an output cap, and caps on the operations that
allocate in C before any check could run (``'A' * 10**9``, ``x.center(10**9)``,
doubling a string with ``~`` or ``+``).  Attacks and ``raise_exception(...)``
come out as :class:`~localinfer.errors.TemplateError`.

Text the user typed never becomes special tokens: messages are rendered once
with placeholders, the template's own text is tokenized with special-token
parsing and each message's text without it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localinfer.errors import TemplateError
from localinfer.util.deadline import Deadline, TimeLimitExceeded

TIME_LIMIT_S = 2.0
MAX_OUTPUT_CHARS = 8 << 20        # rendered prompt and any intermediate string or list
MAX_TEMPLATE_CHARS = 256 << 10    # template source
MAX_RANGE = 100_000
ROLES = ("system", "user", "assistant", "tool")
_WIDE = re.compile(r"[0-9]{7,}")  # a field width or precision of a million or more

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _refuse(what: str) -> SecurityError:
    return SecurityError(f"{what} is over the template limit of {MAX_OUTPUT_CHARS:,} characters")


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 0


class _Generator(CodeGenerator):
    """Compiles ``a ~ b`` through a length-checked join."""

    def visit_Concat(self, node, frame):
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _Generator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         keep_trailing_newline=True)
        self.deadline: Deadline | None = None
        self.globals.update(range=self._range, raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.filters = {name: self._checked(f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._checked(_tojson)

    def _tick(self) -> None:
        if self.deadline is not None:
            self.deadline.check()

    def checked_concat(self, parts: Iterable[Any]) -> str:
        parts = [str(p) for p in parts]
        if sum(map(len, parts)) > MAX_OUTPUT_CHARS:
            raise _refuse("a joined string")
        return "".join(parts)

    def call_binop(self, context, operator, left, right):
        self._tick()
        if operator == "*":
            n, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(n, int) and _size(seq) * max(n, 0) > MAX_OUTPUT_CHARS:
                raise _refuse("a repeated string or list")
        elif operator == "**":
            if isinstance(right, (int, float)) and isinstance(left, (int, float)) and abs(right) > 64 and abs(left) > 1:
                raise SecurityError("exponent too large in template")
        elif operator == "+":
            if _size(left) + _size(right) > MAX_OUTPUT_CHARS:
                raise _refuse("a concatenated string or list")
        elif operator == "%" and isinstance(left, str) and (_WIDE.search(left) or "*" in left):
            raise SecurityError("format width too large in template")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        self._tick()
        _check_args(getattr(obj, "__name__", ""), getattr(obj, "__self__", None), args, kwargs)
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value):
        f_self = getattr(value, "__self__", None)
        if isinstance(f_self, str) and getattr(value, "__name__", "") in ("format", "format_map") and _WIDE.search(f_self):
            raise SecurityError("format width too large in template")
        return super().wrap_str_format(value)

    def getattr(self, obj, attribute):
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._tick()
        return super().getitem(obj, argument)

    def _checked(self, f):
        def filter_(*args, **kwargs):
            self._tick()
            plain = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext))]
            _check_args(getattr(f, "__name__", ""), plain[0] if plain else None, plain[1:], kwargs)
            return f(*args, **kwargs)

        for attr in ("jinja_pass_arg",):
            if hasattr(f, attr):
                setattr(filter_, attr, getattr(f, attr))
        return filter_

    def _range(self, *args):
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise SecurityError(f"range of {len(r):,} items is over the template limit of {MAX_RANGE:,}")
        return _TimedRange(r, self)


class _TimedRange:
    def __init__(self, r: range, env: _Sandbox):
        self.r, self.env = r, env

    def __len__(self):
        return len(self.r)

    def __iter__(self):
        for i in self.r:
            self.env._tick()
            yield i


def _check_args(name: str, target: Any, args: Sequence[Any], kwargs: dict) -> None:
    """Refuse calls that would allocate a huge string before returning."""
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS for v in values):
        raise SecurityError(f"argument too large in template call {name or ''}".strip())
    if isinstance(target, str):
        if "replace" in name and len(values) >= 2 and isinstance(values[1], str):
            old = values[0] if isinstance(values[0], str) else ""
            hits = len(target) + 1 if old == "" else target.count(old)
            if hits * len(values[1]) > MAX_OUTPUT_CHARS:
                raise _refuse("a replaced string")
        if "format" in name and (_WIDE.search(target) or any(isinstance(v, str) and _WIDE.search(v) for v in values)):
            raise SecurityError("format width too large in template")


def _raise_exception(message: Any = "the chat template refused these messages") -> None:
    raise TemplateError(f"chat template: {message}", hint="check the roles and order of the messages")


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 200:
        raise SecurityError("bad strftime format")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False,
            separators: Any = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=tuple(separators) if separators else None)


@dataclass(frozen=True)
class Segment:
    """A piece of a rendered prompt: template text (special tokens parsed) or message text (never parsed)."""

    text: str
    user: bool


class ChatTemplate:
    """A compiled chat template plus the token strings it is rendered with."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "gguf",
                 time_limit: float = TIME_LIMIT_S):
        if not isinstance(source, str) or not source.strip():
            raise TemplateError(f"the chat template from {origin} is empty", hint="pass --chat-template FILE")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"the chat template from {origin} is {len(source):,} characters; the limit is "
                                f"{MAX_TEMPLATE_CHARS:,}", hint="pass a smaller --chat-template FILE")
        self.source, self.origin, self.time_limit = source, origin, time_limit
        self.bos_token, self.eos_token = bos_token, eos_token
        self._env = _Sandbox()
        try:
            self._template = self._env.from_string(source)
        except TemplateSyntaxError as exc:
            raise TemplateError(f"chat template from {origin} has a syntax error on line {exc.lineno}: {exc.message}",
                                hint="fix the template, or pass --chat-template FILE") from None
        except (SecurityError, RecursionError, MemoryError) as exc:
            raise TemplateError(f"chat template from {origin} was refused: {exc}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kw) -> ChatTemplate:
        """Load an override template (``--chat-template FILE``)."""
        from localinfer.util.files import TOO_LARGE, read_capped

        def refuse(problem, exc):                 # a FIFO would block the read, /dev/zero never end
            if problem == TOO_LARGE:
                return TemplateError(f"chat template {path} is over {MAX_TEMPLATE_CHARS * 4:,} bytes",
                                     hint="pass a smaller --chat-template FILE")
            why = exc.strerror if exc is not None and exc.strerror else "not a regular file"
            return TemplateError(f"cannot read chat template {path}: {why}", hint="check the path")

        data = read_capped(path, MAX_TEMPLATE_CHARS * 4, refuse)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise TemplateError(f"chat template {path} is not UTF-8 text") from None
        return cls(text, origin=os.fspath(path), **kw)

    # ---- rendering -----------------------------------------------------------
    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for messages (each ``{"role", "content"}``)."""
        return self._render(check_messages(messages), add_generation_prompt, extra)

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        ctx = dict(extra, messages=messages, add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token, eos_token=self.eos_token)
        out: list[str] = []
        size = 0
        self._env.deadline = Deadline(self.time_limit)
        try:
            with self._env.deadline:
                for piece in self._template.generate(ctx):
                    size += len(piece)
                    if size > MAX_OUTPUT_CHARS:
                        raise _refuse("the rendered prompt")
                    out.append(piece)
        except TemplateError:
            raise
        except TimeLimitExceeded:
            raise TemplateError(f"chat template from {self.origin} ran longer than {self.time_limit:g} s",
                                hint="the template loops too much; pass --chat-template FILE") from None
        except SecurityError as exc:
            raise TemplateError(f"chat template from {self.origin} was refused by the sandbox: {exc}",
                                hint="the template tries something unsafe; pass --chat-template FILE") from None
        except RecursionError:
            raise TemplateError(f"chat template from {self.origin} recursed too deeply") from None
        except MemoryError:
            raise TemplateError(f"chat template from {self.origin} ran out of memory") from None
        except Exception as exc:  # noqa: BLE001 - any failure of untrusted code: UndefinedError, TypeError...
            raise TemplateError(f"chat template from {self.origin} failed: {type(exc).__name__}: {exc}",
                                hint="pass --chat-template FILE, or --raw to skip the template") from None
        finally:
            self._env.deadline = None
        return "".join(out)

    def segments(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                 **extra: Any) -> tuple[list[Segment], list[str]]:
        """The rendered prompt split into template text and message text.

        Returns (segments, unlocated): contents the template rewrote so that
        they could not be found in its output (their text then sits inside
        template segments).  ``extra``: more template variables (``tools=``).
        """
        messages = check_messages(messages)
        real = self._render(messages, add_generation_prompt, extra)
        nonce = secrets.token_hex(6)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        masked = self._render([dict(m, content=marks[i]) for i, m in enumerate(messages)], add_generation_prompt,
                              extra)
        parts = re.split(f"\ue000{nonce}:([0-9]+)\ue001", masked)
        segs = []
        for j, part in enumerate(parts):
            if j % 2 == 0:
                segs.append(Segment(part, False))
            else:
                segs.append(Segment(messages[int(part)]["content"], True))
        if "".join(s.text for s in segs) == real:
            return [s for s in segs if s.text], []
        return _locate(real, [m["content"] for m in messages])

    def tokens(self, engine, messages: Sequence[dict], *, add_generation_prompt: bool = True,
               **extra: Any) -> list[int]:
        """Prompt token ids: template text with special tokens, message text without.  ``extra`` (``tools=``)
        is rendered as template text: a caller that takes it from a user checks it holds no special-token text."""
        segs, unlocated = self.segments(messages, add_generation_prompt=add_generation_prompt, **extra)
        check = getattr(engine, "check_text_fits", None)
        if check is not None:  # refuse by bytes before tokenizing megabytes
            check(sum(len(s.text.encode("utf-8", "replace")) for s in segs), "the templated prompt")
        for text in unlocated:
            if engine.tokenize(text, special=True) != engine.tokenize(text, special=False):
                raise TemplateError("this chat template rewrites message text that contains special-token text, "
                                    "so it cannot be kept plain", hint="pass --chat-template FILE, or --raw")
        ids: list[int] = []
        for s in segs:
            ids.extend(engine.tokenize(s.text, special=not s.user))
        bos = getattr(engine, "bos_id", None)
        if getattr(engine, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids


def _locate(real: str, contents: list[str]) -> tuple[list[Segment], list[str]]:
    """Find each message's text in order in the real rendering (for templates that rewrite text)."""
    segs, unlocated, pos = [], [], 0
    for text in contents:
        if not text:
            continue
        at = real.find(text, pos)
        if at < 0:
            unlocated.append(text)
            continue
        if at > pos:
            segs.append(Segment(real[pos:at], False))
        segs.append(Segment(text, True))
        pos = at + len(text)
    if pos < len(real):
        segs.append(Segment(real[pos:], False))
    return segs, unlocated


TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def check_messages(messages: Sequence[dict]) -> list[dict]:
    """Validate a conversation: a list of {role, content} with known roles and string content (plus an assistant's
    ``tool_calls`` and a tool result's ``tool_call_id`` and ``name``, passed through)."""
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list of {role, content} objects")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TemplateError(f"message {i} needs a string 'role' and a string 'content'")
        if m["role"] not in ROLES:
            raise TemplateError(f"message {i} has role {m['role']!r}", hint="roles: " + ", ".join(ROLES))
        total += len(m["content"])
        if total > MAX_OUTPUT_CHARS:
            raise TemplateError(f"the conversation is over {MAX_OUTPUT_CHARS:,} characters")
        out.append({"role": m["role"], "content": m["content"], **{k: m[k] for k in TOOL_KEYS if k in m}})
    return out


def template_for(spec=None, path: str | os.PathLike | None = None, *, bos_token: str = "",
                 eos_token: str = "") -> ChatTemplate:
    """The template to use: ``--chat-template FILE``, else the GGUF's, else ChatML."""
    if path is not None:
        return ChatTemplate.from_file(path, bos_token=bos_token, eos_token=eos_token)
    source = getattr(spec, "chat_template", None)
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, origin="the GGUF metadata")
    return ChatTemplate(CHATML, bos_token=bos_token, eos_token=eos_token, origin="the built-in ChatML fallback")


def template_with_vocab(spec, vocab, path: str | os.PathLike | None = None) -> ChatTemplate:
    """``template_for(spec, path)`` with the BOS and EOS texts the template may print, read from ``vocab``.

    ``vocab`` is anything with ``token_text`` and ``bos_id`` (an engine, a tokenizer); the EOS is the spec's.
    """
    def text(token: int | None) -> str:
        return "" if token is None else vocab.token_text(token)

    return template_for(spec, path, bos_token=text(getattr(vocab, "bos_id", None)),
                        eos_token=text(getattr(spec, "eos_token_id", None)))
