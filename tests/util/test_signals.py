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
    old = {s: signal.getsignal(s) for s in (*signals.SIGNALS, signal.SIGINT)}
    signals.install()
    yield
    for s, h in old.items():
        signal.signal(s, h)


def _kill(sig=signal.SIGTERM):
    import time

    signal.pthread_kill(threading.main_thread().ident, sig)   # to this thread: with os.kill the kernel may hand
    #   it to a native helper thread, and CPython runs the Python-level handler only later (not reproducible)
    end = time.monotonic() + 2     # outside a native block the handler raises in this loop; inside,
    while time.monotonic() < end and signals.pending() is None:   # a callback would see pending()
        time.sleep(0.001)   # a bare busy loop may not run the Python-level handler (CPython checks it lazily)


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


def test_ctrl_c_inside_native_code_waits_too_and_a_termination_wins(installed):
    with pytest.raises(KeyboardInterrupt) as ei:
        with signals.native():
            _kill(signal.SIGINT)                   # was: raised inside llama.cpp's log callback and lost
            assert signals.pending() == signal.SIGINT
    assert not isinstance(ei.value, Terminated)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(Terminated):
        with signals.native():
            _kill(signal.SIGTERM)
            _kill(signal.SIGINT)


def test_a_signal_handed_to_another_thread_still_interrupts_a_blocking_read(installed):
    # was: chat at its prompt ignored SIGTERM when the kernel gave it to an idle thread (OpenBLAS's)
    import time

    r, w = os.pipe()
    ready, done = threading.Event(), threading.Event()

    def idle():
        ready.set()
        done.wait(10)

    other = threading.Thread(target=idle)
    other.start()
    ready.wait()
    threading.Timer(0.2, signal.pthread_kill, (other.ident, signal.SIGTERM)).start()
    unblock = threading.Timer(5, os.write, (w, b"x"))          # so a failure cannot hang the suite
    unblock.start()
    start = time.monotonic()
    try:
        with pytest.raises(Terminated):
            with signals.waiting_for_input():
                os.read(r, 1)
        assert time.monotonic() - start < 2
    finally:
        unblock.cancel()
        done.set()
        other.join()
        os.close(r)
        os.close(w)


def test_a_signal_with_a_handler_of_its_own_is_left_to_it(installed):
    import time

    got = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        with signals.native():                     # neither blocked nor recorded
            os.kill(os.getpid(), signal.SIGINT)
            end = time.monotonic() + 2
            while not got and time.monotonic() < end:
                pass
            assert got and signals.pending() is None
    finally:
        signal.signal(signal.SIGINT, old)
