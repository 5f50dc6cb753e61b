"""A reply's text, token by token: the one incremental decoder that Runner, the batch and the HTTP server share.

Token bytes are decoded as UTF-8 across token boundaries (a character split over
two tokens comes out whole with the second); end-of-generation tokens add no
text; a stop string ends the text and is not part of it, and a tail that could
still grow into one is held back until it cannot.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Collection, Sequence

from localinfer.errors import UsageError

MAX_STOP_STRINGS = 16


class ReplyText:
    """Incremental text of one reply; ``feed`` each token, then ``flush`` once it has finished."""

    def __init__(self, token_bytes: Callable[[int], bytes], stops: Sequence[str],
                 eos_ids: Collection[int] = frozenset()):
        self.token_bytes, self.stops, self.eos = token_bytes, list(stops), eos_ids
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held: str | None = ""    # None once a stop string matched or the text was flushed
        self.stopped = False          # a stop string matched
        self.tokens = 0               # tokens fed (end-of-generation ones included)
        self.offset = 0               # characters released so far

    def feed(self, token: int) -> str:
        """Text that is safe to release after this token ('' while a stop string may be forming)."""
        self.tokens += 1
        if self.stopped or self.held is None or token in self.eos:
            return ""
        text, self.held, self.stopped = split_stop(self.held + self.utf8.decode(self.token_bytes(token)), self.stops)
        self.offset += len(text)
        return text

    def flush(self) -> str:
        """What was held back, once; '' after a stop string.  A character the reply was cut in the middle of
        (its last token's bytes start a UTF-8 sequence that never ends) is left out, not shown as U+FFFD."""
        if self.held is None:
            return ""
        self.utf8.reset()
        text, self.held = self.held, None
        self.offset += len(text)
        return text


def check_stops(stop: Sequence[str]) -> list[str]:
    """The non-empty stop strings; at most MAX_STOP_STRINGS of up to 256 characters."""
    if isinstance(stop, str):
        stop = [stop]
    stops = [s for s in stop if s]
    if len(stops) > MAX_STOP_STRINGS or any(not isinstance(s, str) or len(s) > 256 for s in stops):
        raise UsageError(f"at most {MAX_STOP_STRINGS} stop strings of up to 256 characters", flag="--stop")
    return stops


def split_stop(text: str, stops: list[str]) -> tuple[str, str | None, bool]:
    """(text safe to emit, text held back, whether a stop string was hit).

    Held-back text is the longest tail that could still grow into a stop string;
    after a hit nothing is held (``None``).
    """
    if not stops:
        return text, "", False
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], None, True
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return text[: len(text) - keep], text[len(text) - keep:], False
