"""A wall-clock limit for pure-Python work that may loop (template rendering).

Cooperative checks (:meth:`Deadline.check`) catch most overruns cheaply; a
watchdog timer raises :class:`TimeLimitExceeded` asynchronously in the
guarded thread for loops that never reach a check (CPython's
``PyThreadState_SetAsyncExc``).  C-level work that allocates a lot must be
refused before it starts; no watchdog can stop it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Self


class TimeLimitExceeded(BaseException):
    """Raised inside the guarded block when its time is up (a BaseException, so
    ``except Exception`` in library code does not swallow it)."""


def _set_async(tid: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), exc)


class Deadline:
    """``with Deadline(2.0): ...`` raises TimeLimitExceeded after 2 s."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = float("inf")
        self._lock = threading.Lock()
        self._active = False
        self._fired = False
        self._timer: threading.Timer | None = None
        self._tid = 0

    def check(self) -> None:
        if time.perf_counter() > self.end:
            raise TimeLimitExceeded(f"over {self.seconds:g} s")

    def _fire(self) -> None:
        with self._lock:
            if self._active:
                self._fired = True
                _set_async(self._tid, ctypes.py_object(TimeLimitExceeded))

    def __enter__(self) -> Self:
        self._tid = threading.get_ident()
        self.end = time.perf_counter() + self.seconds
        self._active, self._fired = True, False
        self._timer = threading.Timer(self.seconds + 0.05, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        with self._lock:
            self._active = False
            fired = self._fired
        self._timer.cancel()
        if fired:
            _set_async(self._tid, None)  # drop it if it has not been raised yet
            if exc_type is None:
                raise TimeLimitExceeded(f"over {self.seconds:g} s")
        return False
