"""Random add / step / cancel sequences for property tests of the serving engine."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from localinfer.serve.request import Request

# (op, prompt size, max tokens); "step" twice as likely as the others
OPS = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "cancel"]), st.integers(1, 40), st.integers(1, 12)),
               max_size=40)


def apply_ops(e, seq, shared: tuple[int, ...], check: Callable[[object], None]) -> None:
    """Apply ``seq`` to engine ``e`` (odd-sized prompts start with ``shared``), calling ``check(e)`` after each."""
    n = 0
    for op, size, out in seq:
        if op == "add":
            prompt = (shared if size % 2 else ()) + tuple(range(10_000 * n, 10_000 * n + size))
            e.add_request(Request(f"q{n}", prompt, out, arrival_s=e.executor.clock()))
            n += 1
        elif op == "step":
            e.step()
        elif n:
            e.cancel(f"q{size % n}")
        check(e)
