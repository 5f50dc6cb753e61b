"""The chat REPL: a conversation over ``Runner.stream``.

Keys: Ctrl-C while a reply streams stops it within one decode step (or one
abortable prefill graph) and keeps the partial reply, marked; Ctrl-C at the
prompt only clears the line; Ctrl-D or ``/exit`` leaves.  A full context stops
the reply with a message, or with ``context_shift`` the oldest turns leave the
model's view (they stay in the transcript).  Transcripts are written atomically.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TextIO

from localinfer.errors import LocalinferError, UsageError
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import Sampler, SamplingParams, check_max_tokens
from localinfer.model.templates import check_messages
from localinfer.util.atomic import atomic_write, check_writable
from localinfer.util.files import NOT_REGULAR, TOO_LARGE, read_capped
from localinfer.util.signals import Terminated, waiting_for_input

PROMPT = ">>> "
MAX_TRANSCRIPT_BYTES = 16 << 20
FORMAT = "localinfer-chat"
INTERRUPTED = " [interrupted]"
HELP = """commands:
  /help              this list
  /reset             forget the conversation (keeps the system message)
  /stats             timings of the last reply, memory, context use
  /system TEXT       set the system message (/system alone shows it, /system - clears it)
  /save FILE         write the transcript as JSON (atomically)
  /load FILE         read a transcript written by /save
  /set key=value     change a setting: temp, top_k, top_p, min_p, repeat_penalty, seed, max_tokens
  /schema FILE       replies follow the JSON schema in FILE (/schema - drops it)
  /exit              leave (or Ctrl-D)
Ctrl-C stops a reply; a line ending in \\ continues on the next line."""


class ChatSession:
    """One conversation on one engine; ``turn`` runs a user message, ``command`` a /command."""

    def __init__(self, engine, template, *, params: SamplingParams | None = None, max_tokens: int = 512,
                 decoder=None, system: str | None = None, context_shift: bool = False,
                 save_path: str | None = None, out: TextIO = sys.stdout, model_name: str = "",
                 ignore_eos: bool = False):
        self.engine, self.template = engine, template
        self.runner = Runner(engine)
        self.params = params or SamplingParams()
        self.max_tokens = check_max_tokens(max_tokens)
        self.decoder = decoder
        self.system = system
        self.context_shift = context_shift
        self.save_path = save_path
        self.out = out
        self.model_name = model_name
        self.ignore_eos = ignore_eos
        self.sampler = self._sampler()
        self.grammar: str | None = None   # /schema: every reply's grammar
        self.messages: list[dict] = []
        self.start = 0               # messages[start:] are in the model's view
        self.last = None             # the last reply's final chunk
        self.dim = out.isatty() if hasattr(out, "isatty") else False

    def _sampler(self) -> Sampler:
        return Sampler(self.params, banned=self.engine.eos_ids if self.ignore_eos else ())

    # ---- output --------------------------------------------------------------
    def say(self, text: str = "", *, end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def note(self, text: str) -> None:
        self.say(f"\x1b[2m{text}\x1b[0m" if self.dim else text)

    # ---- a turn --------------------------------------------------------------
    def _view(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + [{"role": m["role"], "content": m["content"]} for m in self.messages[self.start:]]

    def _prompt(self) -> list[int] | None:
        """Prompt tokens for the conversation, shifting old turns out if allowed; None if it cannot fit."""
        n_ctx = self.engine.n_ctx
        reserve = min(self.max_tokens, max(1, n_ctx // 4)) if self.context_shift else 1
        while True:
            tokens = self.template.tokens(self.engine, self._view())
            if len(tokens) + reserve <= n_ctx:
                return tokens
            if not self.context_shift or len(self.messages) - self.start <= 1:
                break
            dropped = 2 if len(self.messages) - self.start > 2 else 1
            self.start += dropped
            self.note(f"[context shift: {dropped} oldest message(s) left the model's view]")
        if len(tokens) + 1 > n_ctx:
            self.note(f"[context full: the conversation is {len(tokens)} tokens and the context holds {n_ctx}; "
                      "/reset to start over, or restart with a larger --ctx or with --context-shift]")
            return None
        return tokens

    def turn(self, text: str) -> None:
        """Send one user message and stream the reply."""
        self.messages.append({"role": "user", "content": text})
        try:
            prompt = self._prompt()
        except LocalinferError as exc:
            self.messages.pop()
            self.note(f"error: {exc}{_hint(exc)} (your message was not sent; press Up to edit it)")
            return
        if prompt is None:
            self.messages.pop()
            return
        parts: list[str] = []
        self.sampler.constraint = None
        if self.grammar is not None:
            from localinfer.generation.constraints import Constraint, grammar_tokenizer

            self.sampler.constraint = Constraint(grammar_tokenizer(self.engine), self.grammar, "/schema")
        stream = self.runner.stream(prompt, max_tokens=self.max_tokens, sampler=self.sampler, decoder=self.decoder,
                                    ignore_eos=self.ignore_eos)
        chunk = None
        try:
            for chunk in stream:
                if chunk.text:
                    parts.append(chunk.text)
                    self.say(chunk.text, end="")
        except KeyboardInterrupt as exc:
            _close_quietly(stream)
            self.messages.append({"role": "assistant", "content": "".join(parts), "interrupted": True})
            self.say(INTERRUPTED)
            self.last = None
            self._autosave()
            if isinstance(exc, Terminated):  # SIGTERM/SIGHUP leave chat; Ctrl-C only stops the reply
                raise
            return
        except LocalinferError as exc:
            _close_quietly(stream)
            self.messages.pop()
            self.say()
            self.note(f"error: {exc}{_hint(exc)} (your message was not sent; press Up to edit it)")
            return
        self.say()
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        self.last = chunk
        self.note(self.stats_line())
        if chunk.timings.context_full:
            self.note("[context full: the reply was cut; /reset to start over, or restart with a larger --ctx "
                      "or with --context-shift]")
        self._autosave()

    def stats_line(self) -> str:
        c = self.last
        if c is None:
            return "[no reply yet]"
        tm = c.timings
        parts = [f"{tm.generated} tokens"]
        if tm.decode_tok_s:
            parts.append(f"{tm.decode_tok_s:.1f} tok/s")
        if tm.ttft is not None:
            parts.append(f"TTFT {tm.ttft:.2f} s")
        parts.append(f"context {self.engine.kv_len()}/{self.engine.n_ctx}")
        st = c.stats
        if st is not None and st.drafted:
            parts.append(f"lookup {st.tokens_per_round:.2f} tok/round")
        return "[" + " · ".join(parts) + "]"

    # ---- commands ------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        handler: Callable[[str], bool | None] | None = {
            "/help": lambda a: self.say(HELP), "/?": lambda a: self.say(HELP), "/reset": self._reset,
            "/stats": self._stats, "/system": self._system, "/save": self._save, "/load": self._load,
            "/set": self._set, "/schema": self._schema, "/exit": lambda a: False, "/quit": lambda a: False, "/bye": lambda a: False,
        }.get(name)
        if handler is None:
            self.note(f"unknown command {name}; /help lists them")
            return True
        try:
            return handler(arg) is not False
        except (LocalinferError, OSError) as exc:
            self.note(f"error: {exc}" + (f" ({exc.hint})" if getattr(exc, "hint", None) else ""))
            return True

    def _reset(self, _arg: str) -> None:
        self.messages, self.start, self.last = [], 0, None
        self.runner.reset()
        self.note("[conversation cleared]")

    def _stats(self, _arg: str) -> None:
        self.note(self.stats_line())
        if self.last is not None:
            tm = self.last.timings.as_dict()
            self.note("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in tm.items()))
            if self.last.stats is not None:
                self.note("  decode: " + ", ".join(f"{k}={_fmt(v)}" for k, v in self.last.stats.as_dict().items()))
        mem = self.engine.memory()
        self.note("  memory: " + ", ".join(f"{k}={v / (1 << 20):.1f} MiB" for k, v in mem.items()))
        self.note(f"  messages: {len(self.messages)} ({len(self.messages) - self.start} in view)")

    def _system(self, arg: str) -> None:
        if not arg:
            self.note(f"[system: {self.system!r}]")
            return
        self.system = None if arg == "-" else arg
        self.note("[system message cleared]" if self.system is None else "[system message set]")

    def _schema(self, arg: str) -> None:
        if not arg:
            self.note("[replies follow a JSON schema]" if self.grammar else "[no schema: /schema FILE sets one]")
            return
        if arg == "-":
            self.grammar = None
            self.note("[schema dropped]")
            return
        from localinfer.generation.constraints import grammar_from_file

        self.grammar = grammar_from_file(arg, "json_schema", "/schema")
        self.note(f"[replies follow the JSON schema in {arg}]")

    def _set(self, arg: str) -> None:
        if not arg:
            self.note(" ".join(f"{k}={v}" for k, v in {**self.params.as_dict(), "max_tokens": self.max_tokens}.items()))
            return
        key, eq, value = arg.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise UsageError("use /set key=value, e.g. /set temp=0.7")
        if key in ("max_tokens", "n", "max-tokens"):
            try:
                self.max_tokens = check_max_tokens(int(value), "/set max_tokens")
            except ValueError:
                raise UsageError(f"max_tokens needs a whole number, got {value!r}") from None
        else:
            self.params = self.params.with_setting(key, value)
            self.sampler = self._sampler()
        self.note(f"[{key} = {value}]")

    def transcript(self) -> dict:
        return {"format": FORMAT, "version": 1, "model": self.model_name, "system": self.system,
                "sampling": self.params.as_dict(), "max_tokens": self.max_tokens, "messages": self.messages}

    def _save(self, arg: str) -> None:
        if not arg:
            raise UsageError("use /save FILE")
        path = os.path.expanduser(arg)
        model = getattr(getattr(self.engine, "plan", None), "model_path", None)
        check_writable(path, inputs=[model] if model else [])  # never over the model file
        atomic_write(path, json.dumps(self.transcript(), indent=1, ensure_ascii=False) + "\n")
        self.note(f"[saved {len(self.messages)} messages to {arg}]")

    def _autosave(self) -> None:
        if self.save_path:
            try:
                atomic_write(self.save_path, json.dumps(self.transcript(), indent=1, ensure_ascii=False) + "\n")
            except LocalinferError as exc:  # OutputError: names the path, and says if a previous file was kept
                self.note(f"error: the transcript was not saved: {exc}" + (f" ({exc.hint})" if exc.hint else ""))

    def _load(self, arg: str) -> None:
        if not arg:
            raise UsageError("use /load FILE")
        messages, system = read_transcript(os.path.expanduser(arg))
        self.messages, self.start, self.last = messages, 0, None
        if system is not None:
            self.system = system
        self.note(f"[loaded {len(messages)} messages from {arg}]")

    # ---- the loop ------------------------------------------------------------
    def loop(self, read: Callable[[str], str] = input) -> int:
        """Read lines until /exit or end of input."""
        self.note(f"chat with {self.model_name or 'the model'}; /help for commands, Ctrl-D to leave")
        while True:
            try:
                line = _read_message(read)
            except KeyboardInterrupt as exc:
                if isinstance(exc, Terminated):
                    raise
                self.say()
                self.note("[Ctrl-C: press Ctrl-D or type /exit to leave]")
                continue
            except EOFError:
                self.say()
                return 0
            if not line.strip():
                continue
            if line.startswith("/") and not line.startswith("//"):
                if not self.command(line):
                    return 0
                continue
            try:
                self.turn(line[1:] if line.startswith("//") else line)
            except KeyboardInterrupt as exc:  # between the streaming parts (template, tokenizer)
                if self.messages and self.messages[-1]["role"] == "user":
                    self.messages.append({"role": "assistant", "content": "", "interrupted": True})
                self.say(INTERRUPTED)
                if isinstance(exc, Terminated):
                    raise


def _read_message(read: Callable[[str], str]) -> str:
    with waiting_for_input():  # SIGTERM or Ctrl-C interrupts the read whichever thread the kernel hands it to
        lines = [read(PROMPT)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(read("... "))
    return "\n".join(lines)


def read_transcript(path: str) -> tuple[list[dict], str | None]:
    """(messages, system) from a /save file; raises UsageError naming what is wrong."""
    def refuse(problem: str, exc: OSError | None) -> UsageError:
        if problem == NOT_REGULAR:
            return UsageError(f"{path} is not a regular file", hint="give a transcript written by /save")
        if problem == TOO_LARGE:
            return UsageError(f"{path} is over {MAX_TRANSCRIPT_BYTES >> 20} MiB")
        return UsageError(f"cannot read {path}: {exc.strerror}")

    data = read_capped(path, MAX_TRANSCRIPT_BYTES, refuse)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{path} is not a JSON transcript ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("messages"), list):
        raise UsageError(f"{path} is not a localinfer chat transcript", hint="write one with /save FILE")
    system = doc.get("system")
    if system is not None and not isinstance(system, str):
        raise UsageError(f"{path}: 'system' must be a string")
    try:
        plain = check_messages(doc["messages"])
    except LocalinferError as exc:
        raise UsageError(f"{path}: {exc}") from None
    for m, src in zip(plain, doc["messages"]):
        if src.get("interrupted") is True:
            m["interrupted"] = True
    return plain, system


def _hint(exc: BaseException) -> str:
    hint = getattr(exc, "hint", None)
    return f"; hint: {hint}" if hint else ""


def _close_quietly(stream) -> None:
    for _ in range(3):
        try:
            stream.close()
            return
        except KeyboardInterrupt:
            continue


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
