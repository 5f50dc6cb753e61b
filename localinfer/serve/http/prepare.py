"""A request made ready for the engine (in the server's prep thread): prompt tokens, and the grammar that
constrains the reply with the tool format its calls are read in.

Chat messages go through the model's template (``tools=`` too, when the template
knows tools; the generic format's system message otherwise:
:func:`localinfer.model.tools.generic_messages`).  Tool definitions and the calls in
the history are template text, so text in them that would parse as a special token is
refused (400 naming the field), as message text never becomes one.  The grammar is
compiled once per request against the model's llguidance tokenizer
(:func:`~localinfer.generation.constraints.grammar_tokenizer`, built on first use);
each of the ``n`` choices gets a matcher of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from localinfer.errors import GrammarError, TemplateError
from localinfer.generation.constraints import Constraint, grammar_tokenizer
from localinfer.model.tools import GENERIC, ToolFormat, detect, generic_messages, tool_grammar
from localinfer.serve.http.errors import APIError, bad
from localinfer.serve.http.schemas import GenerationSpec


@dataclass
class Prepared:
    prompt: tuple[int, ...]
    constraint: Constraint | None = None
    tools: ToolFormat | None = None           # read the reply's tool calls in this format
    trigger_token: int | None = None          # the format's trigger when it is one special token
    answer_json: bool = False                 # a reply without calls is response_format's JSON, kept whole

    def constraints(self, n: int) -> list[Constraint | None]:
        """One matcher per choice."""
        c = self.constraint
        return [None if c is None else (c if i == 0 else c.clone()) for i in range(n)]


def prepare(runtime, config, spec: GenerationSpec, vocab=None) -> Prepared:
    """``vocab``: what the chat template tokenises with (the server's, whose byte check measures the
    per-request context: :class:`.intake.ServerVocab`); default the runtime's tokenizer."""
    tok = runtime.tokenizer
    st = spec.structure
    if not spec.chat:
        return Prepared(_prompt(tok, spec), _constraint(tok, st.grammar, st.field) if st else None)
    if not hasattr(config.template, "tokens"):
        config.template = config.template(tok)     # once, in this (single) worker thread
    template = config.template
    messages, extra, fmt, grammar, field, trigger = list(spec.messages), {}, None, None, None, None
    if st is not None and st.tools:
        fmt = detect(template.source)
        _plain(tok, json.dumps(st.tools, ensure_ascii=False), "tools")
        for i, m in enumerate(messages):
            for key in ("tool_calls", "tool_call_id", "name"):
                if key in m:
                    _plain(tok, json.dumps(m[key], ensure_ascii=False), f"messages[{i}].{key}")
        if fmt is GENERIC:
            messages = generic_messages(messages, list(st.tools), st.tool_choice == "required", st.calls_tools)
        else:
            extra["tools"] = [{"type": "function", "function": t} for t in st.tools]
        if st.calls_tools:
            trigger = _special(tok, fmt.trigger)
            tools = [t for t in st.tools if st.named in (None, t["name"])]
            grammar, field = tool_grammar(fmt, tools, required=st.tool_choice == "required", parallel=st.parallel,
                                          trigger_token=trigger, answer=st.answer), "tools"
        else:
            fmt, grammar, field = None, st.grammar, st.field    # tool_choice none: any response_format holds
    elif st is not None:
        grammar, field = st.grammar, st.field
    try:
        prompt = tuple(template.tokens(vocab or tok, messages, **extra))
    except TemplateError as exc:
        raise bad("messages", f"the chat template refused these messages: {exc}", code="template_error") from None
    answer_json = fmt is not None and st is not None and st.answer is not None
    return Prepared(prompt, _constraint(tok, grammar, field), fmt, trigger, answer_json)


def _constraint(tok, grammar: str | None, field: str | None) -> Constraint | None:
    if grammar is None:
        return None
    try:
        return Constraint(grammar_tokenizer(tok), grammar, field or "grammar")
    except GrammarError as exc:
        if exc.facts.get("busy"):
            raise APIError(503, str(exc), param=field, code="grammar_busy", headers={"Retry-After": "1"}) from None
        raise bad(field, str(exc), code="invalid_grammar") from None


def _prompt(tok, spec: GenerationSpec) -> tuple[int, ...]:
    if isinstance(spec.prompt, str):
        return tuple(tok.tokenize(spec.prompt, add_bos=True, special=False))
    bad_ids = [t for t in spec.prompt if not 0 <= t < tok.n_vocab]
    if bad_ids:
        raise bad("prompt", f"prompt token ids must lie in 0..{tok.n_vocab - 1}, got {bad_ids[0]}")
    return spec.prompt


def _plain(tok, text: str, field: str) -> None:
    """400 unless ``text`` holds no special-token text (it is rendered as template text)."""
    if tok.tokenize(text, special=True) != tok.tokenize(text, special=False):
        raise bad(field, f"{field} contains special-token text the model reserves (such as <|im_end|>)")


def _special(tok, text: str) -> int | None:
    """The id of ``text`` when it is one special token of the vocabulary (no output bytes), else None."""
    if not text:
        return None
    ids = tok.tokenize(text, special=True)
    return ids[0] if len(ids) == 1 and not tok.token_bytes(ids[0]) else None
