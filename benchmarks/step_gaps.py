"""Name the steps behind the largest token gaps of a served load: reads ``serve --step-log FILE``.

    localinfer serve --step-log /tmp/steps.jsonl &
    localinfer bench serve --url http://127.0.0.1:8080/v1 --concurrency 4
    python3 benchmarks/step_gaps.py /tmp/steps.jsonl [--top 10]

Each line: a request's gap in ms = the steps that ended inside it (their prompt tokens, decodes and the
requests they seated) + the time between them (parking, the HTTP side, waiting).  Then the steps' time
against the step model's prediction (the gap bound, ``--max-gap``, relies on it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.serve.gaps import largest_gaps  # noqa: E402
from localinfer.serve.step_log import read_step_log  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    records = read_step_log(args.log)
    if not records:
        print(f"{args.log}: no steps", file=sys.stderr)
        return 1
    for gap in largest_gaps(records, args.top):
        print(gap.describe())
    ratios = [(r["end_s"] - r["start_s"]) / r["predicted_s"] for r in records if r.get("predicted_s")]
    if ratios:
        q = statistics.quantiles(ratios, n=100) if len(ratios) > 1 else ratios * 99
        print(f"{len(records)} steps; measured / predicted time: p50 {q[49]:.2f}, p90 {q[89]:.2f}, p99 {q[98]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
