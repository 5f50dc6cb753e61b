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

The kernel hands a process-directed signal to any thread that does not block
it.  The main thread blocks these signals while inside a block, so the threads
llama.cpp starts there (its compute pool) inherit a mask that blocks them;
inside the block, :func:`pending` also reads the kernel's pending set.  Threads
started elsewhere (OpenBLAS's, at numpy's import) may still receive one: the
Python handler then runs at the main thread's next bytecode, which a blocking
read at the chat prompt never reaches, so :func:`waiting_for_input` has a relay
thread (woken through ``signal.set_wakeup_fd``) interrupt that read.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)
_MASKED = {signal.SIGINT, *SIGNALS}
_CAN_MASK = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigpending")
_NUDGE = getattr(signal, "SIGUSR2", None)  # interrupts the main thread's read; its handler does nothing


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
_owned: frozenset = frozenset()  # the signals the outermost native block blocks: those routed to _on_signal


def _record(signum: int) -> None:
    global _pending
    if _pending is None or _pending == signal.SIGINT:
        _pending = signum


def _on_signal(signum, _frame) -> None:
    if _depth:
        _record(signum)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def install() -> None:
    """Route SIGTERM and SIGHUP to :class:`Terminated` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _on_signal)


_stops = threading.local()


@contextmanager
def stops_on(event: threading.Event) -> Iterator[None]:
    """In this thread, :func:`pending` reports SIGTERM once ``event`` is set, so native work that polls it (a
    model load's progress callback) stops: how a server's engine thread hears a signal the main thread took."""
    before = getattr(_stops, "event", None)
    _stops.event = event
    try:
        yield
    finally:
        _stops.event = before


def pending() -> int | None:
    """The signal waiting for the end of the :func:`native` block, if any (for callbacks to poll)."""
    stop = getattr(_stops, "event", None)
    if stop is not None and stop.is_set():
        return signal.SIGTERM
    if _pending is None and _depth and _owned:
        waiting = signal.sigpending() & _owned
        if waiting:
            return max(waiting, key=lambda s: s != signal.SIGINT)
    return _pending


_ELSEWHERE = nullcontext()


def native():
    """Defer these signals while native code runs; raise :class:`Terminated` on the way out.

    Only the main thread receives signals, so elsewhere this does nothing (a shared no-op context: a serving
    engine thread enters one per ``llama_decode``, where a generator's set-up cost ~20 us after each graph).  A
    pending signal replaces whatever exception is leaving the block.
    """
    if threading.current_thread() is not threading.main_thread():
        return _ELSEWHERE
    return _native()


@contextmanager
def _native() -> Iterator[None]:
    global _depth, _pending, _owned
    outermost = not _depth
    sigint = mask = None
    if outermost:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            sigint = signal.signal(signal.SIGINT, _on_signal)
        owned = frozenset(s for s in _MASKED if signal.getsignal(s) is _on_signal)  # others keep their handlers
        if _CAN_MASK and owned:
            _owned = owned
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, owned)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if outermost:
            try:
                if mask is not None:
                    for s in signal.sigpending() & _owned:
                        _record(s)  # what arrived while blocked; unblocking delivers it to the handlers too
                    _depth += 1     # ... which only record it again
                    try:
                        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                    finally:
                        _depth -= 1
                        _owned = frozenset()
            finally:
                if sigint is not None:
                    signal.signal(signal.SIGINT, sigint)
            signum, _pending = _pending, None
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            if signum is not None:
                raise Terminated(signum)


_relay_lock = threading.Lock()
_waiting = False
_prompt = 0      # counts the reads waited for, so a nudge never outlives its read
_relay: threading.Thread | None = None


def _relay_loop(fd: int, main_ident: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if not any(b in _MASKED for b in data):  # each byte is a signal number
            continue
        with _relay_lock:
            prompt = _prompt if _waiting else None
        # Nudge until the main thread leaves this read: a signal that arrives just before the read()
        # syscall starts trips the handler but interrupts nothing, so one nudge can be lost the same way.
        for _ in range(250):
            with _relay_lock:
                if prompt is None or not _waiting or _prompt != prompt:
                    break
                signal.pthread_kill(main_ident, _NUDGE)
            time.sleep(0.02)


def _start_relay() -> bool:
    global _relay
    if _relay is not None:
        return True
    if _NUDGE is None or not _CAN_MASK:
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:  # someone else (an event loop) owns the wakeup fd: leave it alone
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return False
    signal.signal(_NUDGE, lambda *_: None)
    _relay = threading.Thread(target=_relay_loop, args=(r, threading.main_thread().ident),
                              name="localinfer-signal-relay", daemon=True)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _MASKED | {_NUDGE})  # the relay inherits the block:
    try:                                                                  # the kernel never picks it
        _relay.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return True


@contextmanager
def waiting_for_input() -> Iterator[None]:
    """Around a blocking read in the main thread (the chat prompt, stdin): a termination signal or
    Ctrl-C that the kernel handed to another thread still interrupts it (see the module docstring)."""
    global _waiting, _prompt
    if threading.current_thread() is not threading.main_thread() or not _start_relay():
        yield
        return
    with _relay_lock:
        _waiting = True
        _prompt += 1
    try:
        yield
    finally:
        with _relay_lock:
            _waiting = False
