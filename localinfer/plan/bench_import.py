"""Read measured speed (``localinfer bench --json``, ``llama-bench -o json|jsonl``) as a Calibration.

llama-bench rows: ``n_prompt > 0, n_gen == 0`` is a prefill of n_prompt tokens
after n_depth cached ones (``avg_ts`` tokens/s); ``n_gen > 0, n_prompt == 0`` is
decode from depth n_depth (mean context n_depth + n_gen/2).  Combined ``pg``
rows are skipped.  Files are bounded (a calibration is a few KiB).
"""

from __future__ import annotations

import json
import math
import os

from localinfer.errors import UsageError
from localinfer.plan.calibration import Calibration, DecodeSample, PrefillSample
from localinfer.util.files import NOT_REGULAR, TOO_LARGE, read_capped

MAX_BENCH_BYTES = 16 << 20


def _bad(path, message: str) -> UsageError:
    return UsageError(f"--bench {path}: {message}", flag="--bench",
                      hint="pass the JSON written by `localinfer bench --json` or `llama-bench -o json`")


def _num(row: dict, key: str, path, kind=float):
    v = row.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _bad(path, f"field {key!r} is {v!r}; expected a non-negative number")
    return kind(v)


def _kv(row: dict) -> tuple[str, str]:
    return (str(row.get("type_k", "f16")).lower(), str(row.get("type_v", row.get("type_k", "f16"))).lower())


def from_llama_bench(rows: list, path="<data>") -> Calibration:
    """Samples from llama-bench's JSON rows."""
    decode, prefill, model = [], [], ""
    for row in rows:
        if not isinstance(row, dict):
            raise _bad(path, "every llama-bench row must be an object")
        p, g, depth = _num(row, "n_prompt", path, int), _num(row, "n_gen", path, int), _num(row, "n_depth", path, int)
        ts = _num(row, "avg_ts", path)
        model = model or str(row.get("model_filename", ""))
        if ts <= 0 or (p and g):
            continue
        if p:
            prefill.append(PrefillSample(1, p, p / ts, depth))
        elif g:
            decode.append(DecodeSample(1, depth + g // 2, 1.0 / ts, _kv(row)))
    return Calibration(tuple(decode), tuple(prefill), source=f"llama-bench {path}", model=model)


def from_localinfer_bench(data: dict, path="<data>") -> Calibration:
    """Samples from ``localinfer bench --json`` (schema ``localinfer.generation.bench`` v1).

    ``decode[].seconds`` sums the ITLs of ``tokens − 1`` steps taken from context
    ``depth``; the mean step is placed at context depth + tokens/2.
    """
    if data.get("schema") != "localinfer.generation.bench":
        raise _bad(path, f"schema is {data.get('schema')!r}, not 'localinfer.generation.bench'")
    runs = data.get("runs")
    if not isinstance(runs, list):
        raise _bad(path, "no 'runs' list")
    decode, prefill = [], []
    for run in runs:
        if not isinstance(run, dict):
            raise _bad(path, "every run must be an object")
        kv = _kv(run)
        for row in run.get("prefill") or ():
            n, s = _num(row, "tokens", path, int), _num(row, "seconds", path)
            if n and s:
                prefill.append(PrefillSample(1, n, s, _num(row, "depth", path, int)))
        for row in run.get("decode") or ():
            n, s = _num(row, "tokens", path, int), _num(row, "seconds", path)
            if n > 1 and s:
                decode.append(DecodeSample(1, _num(row, "depth", path, int) + n // 2, s / (n - 1), kv))
    model = data.get("model")
    name = model.get("name", "") if isinstance(model, dict) else str(model or "")
    return Calibration(tuple(decode), tuple(prefill), source=f"localinfer bench {path}", model=str(name))


def load_bench(path: str | os.PathLike) -> Calibration:
    """A Calibration from a bench result file (format detected from its content)."""
    def refuse(problem: str, exc: OSError | None) -> UsageError:
        if problem == NOT_REGULAR:
            return _bad(path, "not a regular file; not a bench result")
        if problem == TOO_LARGE:
            return _bad(path, f"larger than {MAX_BENCH_BYTES >> 20} MiB; not a bench result")
        return _bad(path, f"cannot read: {exc.strerror or exc}")

    raw = read_capped(path, MAX_BENCH_BYTES, refuse)
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):      # also nesting too deep, an integer of thousands of digits
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except (ValueError, RecursionError):
            raise _bad(path, "not JSON or JSON lines (or nested too deeply)") from None
    if isinstance(data, list):
        cal = from_llama_bench(data, path)
    elif isinstance(data, dict):
        cal = from_localinfer_bench(data, path)
    else:
        raise _bad(path, "expected a JSON object or a list of rows")
    if not cal:
        raise _bad(path, "holds no usable prefill or decode measurement")
    return cal
