"""OpenAI response objects: text from tokens (with stop strings), choices, chunks, usage and logprobs.

Shapes follow OpenAI's API reference: ``chat.completion`` /
``chat.completion.chunk`` (``delta`` with ``role`` in the first chunk of a
choice) and ``text_completion``; ``usage`` carries ``prompt_tokens``,
``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV came from the
prefix cache).  A stop string ends the reply and is not part of its text.
"""

from __future__ import annotations

import time

from localinfer.generation.text import ReplyText
from localinfer.serve.http.sampler import TokenLogprob

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


class TextStream(ReplyText):
    """Incremental text of one choice (``ReplyText`` over the server's tokenizer)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], eos_ids: frozenset[int]):
        super().__init__(tokenizer.token_bytes, stops, eos_ids)
        self.tok = tokenizer

    def piece(self, token: int) -> str:
        return self.tok.token_bytes(token).decode("utf-8", errors="replace")


def finish_reason(reason: str | None, stopped: bool) -> str | None:
    if stopped:
        return "stop"
    return FINISH.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def envelope(kind: str, rid: str, model: str, created: int | None = None) -> dict:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model}


# ---- logprobs ------------------------------------------------------------------
def chat_logprobs(text: TextStream, entries: list[TokenLogprob]) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``."""
    def one(tok: int, lp: float) -> dict:
        b = text.tok.token_bytes(tok)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries]}


def completion_logprobs(text: TextStream, entries: list[TokenLogprob], offset: int) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (the legacy completions shape)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        piece = text.piece(e.token)
        tokens.append(piece)
        lps.append(e.logprob)
        tops.append({text.piece(t): lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def logprobs_for(chat: bool, text: TextStream, entries: list[TokenLogprob], offset: int = 0) -> dict:
    return chat_logprobs(text, entries) if chat else completion_logprobs(text, entries, offset)


# ---- whole responses and chunks -------------------------------------------------
def choice(chat: bool, index: int, content: str, reason: str | None, logprobs: dict | None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}


def chunk_choice(chat: bool, index: int, content: str | None, reason: str | None, logprobs: dict | None,
                 first: bool) -> dict:
    if chat:
        delta: dict = {"role": "assistant"} if first else {}
        if content is not None:
            delta["content"] = content
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": content or "", "logprobs": logprobs, "finish_reason": reason}


def tool_choice(index: int, content: str | None, calls: list[dict], reason: str | None) -> dict:
    """A chat choice of a request with tools: ``content`` (None when it only called) and ``tool_calls``."""
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}


def delta_choice(index: int, delta: dict) -> dict:
    """A chunk choice carrying one tool-reply delta (content, or a call's header or argument fragment)."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
