"""``serve --step-log FILE``: one JSON line per engine step, what :mod:`localinfer.serve.gaps` reads.

Each line is a :class:`~localinfer.serve.engine.StepRecord` (start and end on the executor's clock,
seconds; the predicted time; each chunk as [request, start, tokens, kind, sampled]; the requests
seated).  Lines are buffered and flushed when the log closes or the buffer fills.
"""

from __future__ import annotations

import json

from localinfer.serve.engine import StepRecord


class StepLog:
    def __init__(self, path: str):
        self._fh = open(path, "a", encoding="utf-8", buffering=1 << 16)

    def __call__(self, record: StepRecord) -> None:
        self._fh.write(json.dumps(record.as_json(), separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_step_log(path: str) -> list[dict]:
    """The records of a step log (a line cut short by a crash is skipped)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
