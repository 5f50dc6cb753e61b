"""One HTTP generation: its engine requests (n choices), their events, and the OpenAI answer they make.

The handler builds a :class:`Reply` after the prompt is tokenised; it
submits the choices to the engine thread and starts the disconnect watcher.
``first()`` waits for the first event so a request refused at admission
(deadline, shutdown) still gets an HTTP error status even when streaming;
then ``response()`` collects the whole answer or ``frames()`` streams it.
``close()`` always runs: it stops the watcher and cancels whatever has not
finished (the client left, or the handler was cancelled).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from localinfer.model.tool_parse import ToolStream
from localinfer.serve.http import responses as R
from localinfer.serve.http import sse
from localinfer.serve.http.direct import DirectSink, Spill
from localinfer.serve.http.errors import APIError
from localinfer.serve.http.prepare import Prepared
from localinfer.serve.http.runtime import Event, Runtime
from localinfer.serve.http.sampler import ServeRequest, sampling_for
from localinfer.serve.http.schemas import GenerationSpec
from localinfer.serve.request import FinishReason


class Reply:
    """``ready``: the request made ready (:class:`.prepare.Prepared`), or a list of them (completions with several
    prompts: choice ``p * n + j`` is prompt p's j-th); ``echo``: each prompt's text, put before its choices'.
    ``scope``: the HTTP request's ASGI scope, given where the stream's token frames may be written by the relay
    thread (:mod:`.direct`: one choice of plain text deltas, streamed as SSE by ``frames``)."""

    def __init__(self, runtime: Runtime, spec: GenerationSpec, ready: Prepared | list[Prepared], max_tokens: int,
                 model: str, receive, eos_ids: frozenset[int], echo: list[str] | None = None, scope=None):
        readies = list(ready) if isinstance(ready, (list, tuple)) else [ready]
        self.prompts = [r.prompt for r in readies]
        self.runtime, self.spec, self.prompt, self.model = runtime, spec, readies[0].prompt, model
        self.ready = readies[0]
        self.echo = echo
        constraints = [c for r in readies for c in r.constraints(spec.n)]
        self.id = ("chatcmpl-" if spec.chat else "cmpl-") + uuid.uuid4().hex[:24]
        deadline = None if spec.deadline_ms is None else spec.deadline_ms / 1e3

        def make(rid, tokens, arrival, i):
            return ServeRequest(rid, tokens, max_tokens, arrival_s=arrival,
                                deadline_s=None if deadline is None else arrival + deadline,
                                sampling=sampling_for(spec.sampling, i % spec.n),
                                stop_tokens=frozenset() if spec.ignore_eos else eos_ids,
                                banned=eos_ids if spec.ignore_eos else frozenset(),
                                presence_penalty=spec.presence_penalty, frequency_penalty=spec.frequency_penalty,
                                top_logprobs=spec.logprobs, logit_bias=spec.logit_bias,
                                constraint=constraints[i])

        every = [p for p in self.prompts for _ in range(spec.n)]
        self.texts = [R.TextStream(runtime.tokenizer, spec.stop, eos_ids) for _ in every]
        self.tools = ([ToolStream(self.ready.tools, self.ready.answer_json) for _ in every]
                      if self.ready.tools is not None else None)
        self._base = R.envelope("chat.completion.chunk" if spec.chat else "text_completion", self.id, model)
        self._extra = {"usage": None} if spec.include_usage else {}
        self._plain: dict[int, tuple] = {}   # a choice's text delta frame, before and after its JSON string
        plain = spec.stream and self.tools is None and spec.logprobs is None and len(every) == 1
        self.sink = DirectSink.for_scope(scope, self._token_frame) if plain and scope is not None else None
        self.handles, self.queue = runtime.submit(every, make, asyncio.get_running_loop(), sink=self.sink)
        self.reasons: list[str | None] = [None] * len(self.handles)
        self.client_gone = False
        self._first: Event | None = None
        self._watcher = sse.watch_disconnect(receive, self._disconnected)

    # ---- events ----------------------------------------------------------------
    def _disconnected(self) -> None:
        self.client_gone = True
        if self.sink is not None:
            self.sink.close()
        for h in self.handles:
            self.runtime.cancel(h)
        self.queue.put_nowait(None)             # wake a waiting reader

    async def _next(self) -> Event | Spill | None:
        if self._first is not None:
            ev, self._first = self._first, None
        else:
            ev = await self.queue.get()
        if ev is not None and self.sink is not None:
            self.sink.consumed()       # counted as taken here, not in first(): its frame is written after this
        return ev

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    async def first(self) -> None:
        """Wait for the first event; APIError when the request was refused before any token."""
        ev = await self.queue.get()
        if ev is None:
            return
        if ev.reason is not None and self.texts[ev.index].tokens == 0:
            err = self._refusal(ev)
            if err is not None:
                raise err
        self._first = ev

    def _refusal(self, ev: Event) -> APIError | None:
        if ev.reason is FinishReason.DEADLINE:
            return APIError(429, f"the server cannot finish this request within deadline_ms="
                                 f"{self.spec.deadline_ms:g} at its current load", param="deadline_ms",
                            code="deadline_unmeetable", headers={"Retry-After": "1"})
        if ev.reason is FinishReason.CANCELLED and not self.client_gone:
            return APIError(503, "the server is shutting down", code="shutting_down")
        if ev.reason is FinishReason.ERROR:
            return APIError(500, f"the engine failed on this request: {ev.error or 'unknown error'}",
                            code="engine_error")
        return None

    def _cut(self, ev: Event) -> APIError | None:
        """The error a choice's end makes when it is neither stop nor length (the only finish_reason values
        OpenAI's clients know): refused before its first token, or cut after it by an engine error, its
        deadline passing or the server shutting down.  None for a normal end, or when the client left."""
        text = self.texts[ev.index]
        if ev.reason in (None, FinishReason.STOP, FinishReason.LENGTH) or text.stopped or self.client_gone:
            return None
        if ev.reason is FinishReason.DEADLINE and text.tokens:
            return APIError(504, f"deadline_ms={self.spec.deadline_ms:g} passed after {text.tokens} tokens, "
                                 "before the reply was finished", param="deadline_ms", code="deadline_exceeded")
        return self._refusal(ev) or APIError(500, "the request ended without output", code="engine_error")

    def _apply(self, ev: Event) -> tuple[str, list] | None:
        """Feed one token event to its choice: (new text, logprob entries), or None if the choice stopped."""
        text = self.texts[ev.index]
        if text.stopped:
            return None
        seen = text.tokens
        delta = text.feed(ev.token)
        if self.tools is not None:
            trig = self.ready.tools.trigger if ev.token == self.ready.trigger_token else ""
            return self.tools[ev.index].feed(trig + delta), []
        lps = []
        if self.spec.logprobs is not None and ev.token not in text.eos and not text.stopped:
            entries = self.handles[ev.index].request.logprobs
            lps = entries[seen:seen + 1]
        if text.stopped:
            self.runtime.cancel(self.handles[ev.index], quiet=True)
        return delta, lps

    def _finish(self, ev: Event):
        """The choice's last text (its last deltas for a tool reply) and its finish reason set."""
        text = self.texts[ev.index]
        self.reasons[ev.index] = R.finish_reason(ev.reason, text.stopped)
        tail = text.flush()
        if self.tools is None:
            return tail
        stream = self.tools[ev.index]
        deltas = stream.feed(tail) + stream.finish(cut=self.reasons[ev.index] == "length")
        if stream.result()[1] and self.reasons[ev.index] == "stop":
            self.reasons[ev.index] = "tool_calls"
        return deltas

    def usage(self) -> dict:
        cached = max((h.request.cached for h in self.handles), default=0)
        return R.usage(sum(map(len, self.prompts)), sum(t.tokens for t in self.texts), cached)

    def _echo(self, index: int) -> str:
        return "" if self.echo is None else self.echo[index // self.spec.n]

    # ---- answers -----------------------------------------------------------------
    async def response(self) -> dict:
        """The whole non-streaming answer."""
        parts = [[] for _ in self.handles]
        lps = [[] for _ in self.handles]
        cut = None
        while not self.done:
            ev = await self._next()
            if ev is None:
                continue                          # the client left: the cancels' finishes follow
            if ev.reason is not None:
                if cut is None and (cut := self._cut(ev)) is not None:
                    self._cancel_rest()           # the answer is an error now: the other choices stop too
                tail = self._finish(ev)
                if self.tools is None:
                    parts[ev.index].append(tail)
                continue
            got = self._apply(ev)
            if got is not None and self.tools is None:
                parts[ev.index].append(got[0])
                lps[ev.index] += got[1]
        if self.client_gone:
            raise APIError(499, "the client closed the request", code="client_closed")   # nginx's 499; nobody reads it
        if cut is not None:
            raise cut                             # a reply cut short is an error, not a 200 with half a text
        kind = "chat.completion" if self.spec.chat else "text_completion"
        out = R.envelope(kind, self.id, self.model)
        out["choices"] = [R.choice(self.spec.chat, i, self._echo(i) + "".join(parts[i]), self.reasons[i],
                                   None if self.spec.logprobs is None else
                                   R.logprobs_for(self.spec.chat, self.texts[i], lps[i]))
                          if self.tools is None else
                          R.tool_choice(i, *self.tools[i].result(cut=self.reasons[i] == "length"), self.reasons[i])
                          for i in range(len(self.handles))]
        out["usage"] = self.usage()
        return out

    def _frame(self, choices) -> bytes:
        return sse.event({**self._base, "choices": choices, **self._extra})

    def _token_frame(self, ev: Event) -> bytes | None:
        """A token event's frame (no tools): None when it adds no text (held back, stopped, end of generation).
        Run by the loop, or by the relay thread for tokens routed while the stream's sink is on (never both at
        once: :mod:`.direct`)."""
        got = self._apply(ev)
        if got is None or (not got[0] and not got[1]):
            return None
        chat, text = self.spec.chat, self.texts[ev.index]
        plain = self._plain.get(ev.index) if self.spec.logprobs is None else ()
        if plain is None:      # the choice's frame with a marker for its text, cut around it once
            mark = "delta-" + uuid.uuid4().hex
            parts = self._frame([R.chunk_choice(chat, ev.index, mark, None, None, False)]).split(sse.text(mark))
            plain = self._plain[ev.index] = (parts[0], parts[1]) if len(parts) == 2 else ()
        if plain:
            return plain[0] + sse.text(got[0]) + plain[1]
        lp = None if self.spec.logprobs is None else R.logprobs_for(chat, text, got[1], text.offset - len(got[0]))
        return self._frame([R.chunk_choice(chat, ev.index, got[0], None, lp, False)])

    async def frames(self) -> AsyncIterator[bytes | Spill]:
        """The streaming answer as SSE frames, ending with the usage chunk (if asked) and [DONE]; a ``Spill`` is
        bytes the relay thread did not write (whole), to be written as they are (:mod:`.direct`)."""
        chat, frame = self.spec.chat, self._frame
        for i in range(len(self.handles)):
            if chat or self.echo is not None:
                yield frame([R.chunk_choice(chat, i, "" if chat else self._echo(i), None, None, first=True)])
        while not self.done:
            ev = await self._next()
            if ev is None:
                continue
            if isinstance(ev, Spill):
                yield ev
                continue
            if ev.reason is not None:
                cut = self._cut(ev)
                tail = self._finish(ev)
                if self.tools is not None:
                    for d in tail:
                        yield frame([R.delta_choice(ev.index, d)])
                    tail = ""
                if cut is not None:               # OpenAI's clients raise on an error event: the stream ends
                    if tail:
                        yield frame([R.chunk_choice(chat, ev.index, tail, None, None, False)])
                    yield sse.event(cut.body())
                    self._cancel_rest()
                    yield sse.DONE                # no usage chunk: the client raised at the error
                    return
                yield frame([R.chunk_choice(chat, ev.index, tail or None, self.reasons[ev.index], None, False)])
                continue
            if self.tools is not None:
                got = self._apply(ev)
                for d in (got[0] if got is not None else ()):
                    yield frame([R.delta_choice(ev.index, d)])
                continue
            body = self._token_frame(ev)
            if body is not None:
                yield body
        if self.spec.include_usage:
            yield sse.event({**self._base, "choices": [], "usage": self.usage()})
        yield sse.DONE

    async def pieces(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """The answer as (choice, new text, finish reason or None) for the other faces (Ollama, Responses);
        APIError when a choice is cut (engine error, deadline, shutdown) or the client left."""
        while not self.done:
            ev = await self._next()
            if ev is None:
                continue
            if ev.reason is not None:
                cut = self._cut(ev)
                tail = self._finish(ev)
                if cut is not None:
                    self._cancel_rest()
                    raise cut
                yield ev.index, tail, self.reasons[ev.index]
                continue
            got = self._apply(ev)
            if got is not None and got[0]:
                yield ev.index, got[0], None
        if self.client_gone:
            raise APIError(499, "the client closed the request", code="client_closed")

    def completion_tokens(self) -> int:
        return sum(t.tokens for t in self.texts)

    def _cancel_rest(self) -> None:
        for h in self.handles:
            if not h.finished:
                self.runtime.cancel(h, quiet=True)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        self._watcher.cancel()
        for h in self.handles:
            if not h.finished:
                self.runtime.cancel(h)
