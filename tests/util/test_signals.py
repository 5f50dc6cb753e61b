"""SIGTERM/SIGHUP as Terminated: raised at once outside native code, deferred to the end of a native block."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from localinfer.util import signals
from localinfer.util.signals import Terminated


@pytest.fixture
def installed():
    old = {s: signal.getsignal(s) for s in signals.SIGNALS}
    signals.install()
    yield
    for s, h in old.items():
        signal.signal(s, h)


def _kill(sig=signal.SIGTERM):
    os.kill(os.getpid(), sig)
    for _ in range(1000):          # the handler runs between bytecodes of the main thread
        pass


def test_outside_native_code_the_signal_raises(installed):
    with pytest.raises(Terminated) as ei:
        _kill()
    assert ei.value.exit_code == 143 and isinstance(ei.value, KeyboardInterrupt)


def test_sighup_exits_129(installed):
    with pytest.raises(Terminated) as ei:
        _kill(signal.SIGHUP)
    assert ei.value.exit_code == 129


def test_inside_native_code_the_signal_waits_for_the_end_of_the_outermost_block(installed):
    seen = []
    with pytest.raises(Terminated):
        with signals.native():
            with signals.native():
                _kill()
                seen.append(signals.pending())     # a callback would poll this and stop the native work
            seen.append("inner block left")
    assert seen == [signal.SIGTERM, "inner block left"] and signals.pending() is None


def test_a_pending_signal_replaces_the_exception_leaving_the_block(installed):
    with pytest.raises(Terminated):
        with signals.native():
            _kill()
            raise KeyboardInterrupt                # e.g. llama_decode aborted by the callback


def test_other_threads_do_not_defer(installed):
    out = []

    def work():
        with signals.native():
            out.append(signals._depth)             # only the main thread receives signals

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out == [0]
