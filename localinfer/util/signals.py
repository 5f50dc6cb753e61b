"""SIGTERM and SIGHUP as an exception that still reaches the CLI from inside native code.

The CLI installs one handler (:func:`install`).  Outside native code it raises
:class:`Terminated`, a ``KeyboardInterrupt``, so every cleanup path (KV
rollback, temp files) runs.  Inside a :func:`native` block — a call into
llama.cpp, whose log, progress and abort callbacks run Python code where ctypes
prints and drops any exception — the handler only records the signal: the
callbacks poll :func:`pending` to stop the native work, and leaving the block
raises :class:`Terminated`.  Ctrl-C (SIGINT) is deferred the same way inside a
block, while Python's default handler is in place, and raised as
``KeyboardInterrupt`` on the way out (a termination signal wins over it).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)


class Terminated(KeyboardInterrupt):
    """A termination signal, delivered like Ctrl-C; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_depth = 0
_pending: int | None = None


def _on_signal(signum, _frame) -> None:
    global _pending
    if _depth:
        if _pending is None or _pending == signal.SIGINT:
            _pending = signum
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def install() -> None:
    """Route SIGTERM and SIGHUP to :class:`Terminated` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _on_signal)


def pending() -> int | None:
    """The termination signal recorded inside a :func:`native` block, if any (for callbacks to poll)."""
    return _pending


@contextmanager
def native() -> Iterator[None]:
    """Defer termination signals while native code runs; raise :class:`Terminated` on the way out.

    Only the main thread receives signals, so elsewhere this does nothing.  A
    pending signal replaces whatever exception is leaving the block.
    """
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigint = None
    if not _depth and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        sigint = signal.signal(signal.SIGINT, _on_signal)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)
        if not _depth and _pending is not None:
            signum, _pending = _pending, None
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(signum)
