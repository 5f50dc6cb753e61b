"""Constrained decoding on llguidance: grammars, one tokenizer per model, a matcher per request, batched masks.

A :class:`Constraint` holds one reply's ``LLMatcher`` and keeps it equal to the
tokens the reply has (``sync``), so a preempted and recomputed request, a
prefix-cache hit or a draft the step did not keep leaves nothing to repair: the
grammar state is a function of the output tokens, wherever they were computed.
The sampler asks it for the next token's mask (``apply``: tokens the grammar
forbids get logit −inf, end-of-generation ids only where the grammar accepts)
and tells it the token drawn (``consume``).  ``fill_masks`` computes the masks of
every constrained row of a serving step before they are sampled, each draft
position included (prompt-lookup verification draws them in order): in one
llguidance call over its thread pool where there are cores to spare
(``MASK_THREADS``), else row after row; every call releases the GIL.  A mask
asked for a state it was not filled for is computed alone.

Grammars come from a JSON schema, any JSON object, a regex, a list of choices or a
Lark grammar (llguidance's dialect: ``docs/structured.md``); one that does not
compile is a :class:`~localinfer.errors.GrammarError` naming the field it came from.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from localinfer.errors import GrammarError, UsageError
from localinfer.generation.grammar_guard import check_size, guarded

# Compact JSON with a space after ':' and ',' (what chat models write); a schema's own "x-guidance" overrides it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
MAX_CHOICES = 4096
MAX_FILE_BYTES = 4 << 20

# Threads of the batched mask fill.  With one, rows are filled one after another in the calling thread (each
# call releases the GIL): handing a batch to a single worker thread cost more than it saved on a 2-vCPU machine.
MASK_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))

# The additive bias of each mask byte's eight tokens (bit i of the byte is token 8k + i): 0 or −inf.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_executor = None


def _llg():
    try:
        import llguidance
    except ImportError:
        raise UsageError("structured output needs the llguidance package",
                         hint="pip install llguidance (it is in localinfer's serve extra)") from None
    return llguidance


def grammar_from(kind: str, value, field: str) -> str:
    """An llguidance grammar for ``value`` of ``kind`` (one of KINDS); GrammarError naming ``field``.

    Bounded (:mod:`localinfer.generation.grammar_guard`): sizes and depth checked first, the compile in a
    large-stack thread of its own under a time limit."""
    check_size(kind, value, field)
    return guarded(lambda: _compile(kind, value, field), field)


def _compile(kind: str, value, field: str) -> str:
    llg = _llg()
    try:
        if kind == "json_schema":
            if not isinstance(value, (dict, bool)):
                raise GrammarError(f"{field} must be a JSON schema object", field=field)
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        elif kind == "regex":
            if not isinstance(value, str) or not value:
                raise GrammarError(f"{field} must be a non-empty regular expression string", field=field)
            grammar = llg.LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                raise GrammarError(f"{field} must be an array of 1 to {MAX_CHOICES} non-empty strings", field=field)
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        elif kind == "lark":
            if not isinstance(value, str) or not value.strip():
                raise GrammarError(f"{field} must be a non-empty Lark grammar string", field=field)
            grammar = llg.LLMatcher.grammar_from_lark(value)
        elif kind == "gbnf":             # llama.cpp's grammar format (llama-server's ``grammar``), turned into Lark
            if not isinstance(value, str) or not value.strip():
                raise GrammarError(f"{field} must be a non-empty GBNF grammar string", field=field)
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(value)
            except Exception as exc:  # noqa: BLE001 - the converter raises its own and bare Exceptions
                raise GrammarError(f"{field} is not a valid GBNF grammar: {_one_line(exc)}", field=field) from None
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        else:
            raise GrammarError(f"{field}: unknown grammar kind {kind!r}", field=field, hint="kinds: " + ", ".join(KINDS))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{field} is not valid: {_one_line(exc)}", field=field) from None
    check_grammar(grammar, field)
    return grammar


def grammar_from_file(path: str, kind: str, flag: str) -> str:
    """The grammar in a file: a JSON schema (``kind`` json_schema) or a Lark grammar (lark); errors name ``flag``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {flag} file {path}: {exc.strerror}", flag=flag) from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{flag} file {path} is over {MAX_FILE_BYTES >> 20} MiB", flag=flag)
    text = data.decode("utf-8", errors="replace")
    if kind != "json_schema":
        return grammar_from(kind, text, flag)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"{flag} file {path} is not JSON: {exc}", field=flag) from None
    return grammar_from(kind, value, flag)


def response_format_grammar(rf, field: str = "response_format") -> str | None:
    """The grammar of an OpenAI-style ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"schema": ...}}``, ``{"type": "text"}``), a bare JSON schema, or a pydantic model class."""
    if rf is None:
        return None
    if hasattr(rf, "model_json_schema"):             # strict, as OpenAI's client sends a pydantic model
        return grammar_from("json_schema", _closed(rf.model_json_schema()), field)
    if not isinstance(rf, dict):
        raise GrammarError(f"{field} must be a dict or a pydantic model class", field=field)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_from("json_object", None, field)
    if kind == "json_schema" and isinstance(rf.get("json_schema"), dict):
        return grammar_from("json_schema", rf["json_schema"].get("schema"), f"{field}.json_schema.schema")
    return grammar_from("json_schema", rf, field)


def _closed(schema):
    """``schema`` with ``additionalProperties: false`` on every object that does not say."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_grammar(grammar: str, field: str, tokenizer=None) -> None:
    """GrammarError naming ``field`` unless llguidance compiles ``grammar``."""
    err = _llg().LLMatcher.validate_grammar(grammar, tokenizer)
    if err:
        raise GrammarError(f"{field} does not compile: {_one_line(err)}", field=field)


def _one_line(text) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= 300 else s[:297] + "..."


def grammar_tokenizer(vocab):
    """The llguidance tokenizer of a model's vocabulary, built once per vocabulary object.

    ``vocab`` is an engine or tokenizer (``n_vocab``, ``eos_ids``, ``bos_id``, ``token_bytes``, ``token_text``,
    ``tokenize``): every backend reads the GGUF's vocabulary through llama.cpp, so one builder serves them all.
    Tokens with no output bytes (control tokens) become llguidance's special tokens (``<|im_end|>`` in Lark).
    """
    with _lock:
        tok = _tokenizers.get(vocab)
        if tok is None:
            tok = _tokenizers[vocab] = _build_tokenizer(vocab)
        return tok


def _build_tokenizer(vocab):
    llg = _llg()
    tokens = []
    for i in range(vocab.n_vocab):
        b = vocab.token_bytes(i)
        if not b:
            text = vocab.token_text(i)
            b = b"\xff" + text.encode("utf-8", "replace") if text else b""
        tokens.append(b)
    eos = sorted(vocab.eos_ids)

    class Wrapper:
        eos_token_id = eos[0] if eos else 0
        bos_token_id = getattr(vocab, "bos_id", None)
        special_token_ids = ()

        def __init__(self):
            self.tokens = tokens

        def __call__(self, s):
            return vocab.tokenize(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, special=False)

    return llg.LLTokenizer(llg.TokenizerWrapper(Wrapper()), n_vocab=vocab.n_vocab, eos_token=eos or None)


def _mask_executor():
    global _executor
    with _lock:
        if _executor is None:
            _executor = _llg().LLExecutor(MASK_THREADS)
        return _executor


class Constraint:
    """One reply's grammar: its matcher, the tokens it has consumed, and the masks filled for its next tokens."""

    def __init__(self, tokenizer, grammar: str, field: str = "grammar"):
        llg = _llg()
        # building the matcher compiles the grammar again, against the tokenizer: bounded like grammar_from
        self.matcher = guarded(lambda: llg.LLMatcher(tokenizer, grammar, log_level=0), field)
        if self.matcher.is_error():
            raise GrammarError(f"{field} does not compile: {_one_line(self.matcher.get_error())}", field=field)
        self.n_vocab = tokenizer.vocab_size
        self.eos = np.asarray(tokenizer.eos_tokens, dtype=np.int64)
        self.words = (self.n_vocab + 31) // 32
        self.tokens: list[int] = []           # what the matcher has consumed
        self.stop_at: int | None = None       # len(tokens) when the grammar completed
        self._rows: np.ndarray | None = None  # masks filled for len(tokens) == _base + i after draft[:i]
        self._base, self._draft = -1, ()
        self._out = self._bias = self._set = None    # apply's buffers; the ids its last sparse apply set

    def clone(self) -> Constraint:
        """An independent copy in the same state (another choice of the same request)."""
        other = object.__new__(Constraint)
        other.__dict__.update(self.__dict__, matcher=self.matcher.deep_copy(), tokens=list(self.tokens))
        other._rows = other._out = other._bias = other._set = None
        return other

    # ---- state -------------------------------------------------------------
    def sync(self, output: Sequence[int]) -> None:
        """Make the matcher's tokens equal ``output`` (rolling back tokens it no longer has)."""
        t = self.tokens
        keep = min(len(t), len(output))
        while keep and t[keep - 1] != output[keep - 1]:
            keep -= 1
        if keep < len(t):
            self.matcher.rollback(len(t) - keep)
            del t[keep:]
            if self.stop_at is not None and self.stop_at > keep:
                self.stop_at = None
        for tok in output[keep:]:
            self.consume(int(tok))

    def consume(self, token: int) -> None:
        """The token drawn next.  A token the grammar forbids leaves the matcher in error (the reply then ends)."""
        self.matcher.consume_token(token)
        self.tokens.append(token)
        if self.stop_at is None and self.matcher.is_stopped():
            self.stop_at = len(self.tokens)

    def stopped_after(self, n: int) -> bool:
        """Whether the grammar was complete after the first ``n`` tokens (nothing but an end can follow)."""
        return self.stop_at is not None and self.stop_at <= n

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar allows next, in order (a draft is cut there)."""
        if not tokens or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(list(tokens))

    # ---- masks -------------------------------------------------------------
    def _filled(self) -> np.ndarray | None:
        rows, i = self._rows, len(self.tokens) - self._base
        if rows is None or not 0 <= i < len(rows) or (i and tuple(self.tokens[self._base:]) != self._draft[:i]):
            return None
        return rows[i]

    def mask(self) -> np.ndarray:
        """The next token's allowed set, one bit per token (int32 words, llguidance's layout)."""
        row = self._filled()
        if row is None:
            rows = np.zeros((1, self.words), dtype=np.int32)
            self.matcher.unsafe_compute_mask_ptr(rows.ctypes.data, rows.nbytes)
            self._rows, self._base, self._draft = rows, len(self.tokens), ()
            row = rows[0]
        return row

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next: the mask's bit where it was filled, else the matcher's check
        of that one token (a fraction of a microsecond against a mask's tens to thousands).  End-of-generation ids
        only where the grammar accepts, as in the mask."""
        if not 0 <= token < self.n_vocab:
            return False
        row = self._filled()
        if row is not None:
            return bool((int(row[token >> 5]) >> (token & 31)) & 1)
        if self.matcher.is_stopped():         # complete: only an end may follow (validate_tokens says none)
            return token in self.eos
        return self.matcher.validate_tokens([token]) == 1

    def allowed(self) -> np.ndarray:
        """The mask as a bool per token id."""
        return np.unpackbits(self.mask().view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with the tokens the grammar forbids at −inf (ids past the vocabulary too), in a buffer this
        constraint reuses: valid until its next ``apply``.

        A sparse mask (JSON structure, numbers, enums: few words of it have a bit set) copies just the allowed
        logits into the −inf buffer and resets only those next time; a nearly full one (inside a string) copies
        the row and forbids the few; anything else adds a 0 / −inf bias, looked up a mask byte at a time.
        """
        logits = np.asarray(logits, dtype=np.float32)
        n = min(len(logits), self.n_vocab)
        if self._out is None or len(self._out) != len(logits):
            self._out, self._set = np.full(len(logits), -np.inf, dtype=np.float32), None
            self._bias = np.empty((self.words * 4, 8), dtype=np.float32)
        out, words = self._out, self.mask()
        nz = np.flatnonzero(words)
        if len(nz) * 4 <= len(words):
            bits = np.unpackbits(words[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
            rows, cols = np.nonzero(bits)
            ids = nz[rows] * 32 + cols
            ids = ids[ids < n]
            if not len(ids):                 # a matcher in error (a forbidden token was forced): the reply ends
                ids = self.eos[self.eos < n]
            if self._set is None:
                out[:n] = -np.inf
            else:
                out[self._set] = -np.inf
            out[ids] = logits[ids]
            self._set = ids
            return out
        self._set = None
        part = np.flatnonzero(words != -1)
        if len(part) * 4 <= len(words):      # few forbidden (inside a string): copy, then forbid those
            bits = np.unpackbits(words[part].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
            rows, cols = np.nonzero(bits == 0)
            ids = part[rows] * 32 + cols
            np.copyto(out[:n], logits[:n])
            out[ids[ids < n]] = -np.inf
            return out
        bias = self._bias                    # 0 where allowed, −inf where not: eight floats per mask byte
        np.take(_BYTE_BIAS, words.view(np.uint8), axis=0, out=bias)
        np.add(logits[:n], bias.reshape(-1)[:n], out=out[:n])
        return out


def fill_masks(items: Sequence[tuple[Constraint, Sequence[int], Sequence[int]]]) -> None:
    """For each (constraint, output so far, draft): sync the matcher to the output, then fill the masks of its next
    token and of each draft position: one batched llguidance call over ``MASK_THREADS`` threads, or row after row
    with one (every call releases the GIL).  Drafts must be allowed by the grammar (``Constraint.valid_prefix``); masks stop at the first one that is not."""
    if not items:
        return
    batch, at = [], 0
    for c, output, draft in items:
        c.sync(output)
        batch.append((c, at, list(draft)))
        at += 1 + len(draft)
    rows = np.zeros((at, items[0][0].words), dtype=np.int32)
    one = rows.shape[1] * 4
    plain = [(c.matcher, k) for c, k, d in batch if not d]
    drafted = [(c.matcher, k, d) for c, k, d in batch if d]
    if MASK_THREADS > 1 and len(plain) > 1:
        _mask_executor().unsafe_compute_mask_ptr(plain, rows.ctypes.data, one, at)
    else:
        for m, k in plain:
            m.unsafe_compute_mask_ptr(rows[k].ctypes.data, one)
    if drafted:
        _mask_executor().unsafe_compute_mask_ptr_with_draft_token(drafted, rows.ctypes.data, one, at)
    for c, k, d in batch:
        c._rows, c._base, c._draft = rows[k:k + 1 + len(d)], len(c.tokens), tuple(d)
