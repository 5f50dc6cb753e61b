"""`localinfer bench`: measured prefill/decode speed, latency, memory and bandwidth.

For each KV cache type the model is loaded once, then:

* prefill: ``engine.eval`` of a prompt of each length, logits for the last token only;
* decode: a greedy generation of ``gen`` tokens through the Runner after a prompt
  of each depth (EOS banned), giving TTFT, every ITL, and decode tok/s;
* bandwidth: bytes one decode step reads (matrix weights D_w + the KV read at
  that depth, from :mod:`localinfer.model.cost`) × decode tok/s, against the local
  device profile's peak when it has one.

With ``--batch-sizes`` it also measures batch scaling through the serving
engine (measured by :mod:`localinfer.loadgen.batch_scaling`; held and drawn here): b
greedy requests decoding together, tok/s against b, next to the bytes read per
output token d(b, L) = D_w/b + L·k (docs/speed.md).

JSON results (``--json FILE``), schema ``localinfer.generation.bench`` version 2
(version 1 plus ``settings.batch_sizes`` and ``batch_scaling``)::

    {"schema": "localinfer.generation.bench", "version": 1, "created": ISO-8601, "localinfer": "0.1.0",
     "model": {"path", "name", "arch", "file_size", "weight_bytes", "decode_read_bytes", "n_params"},
     "backend": {"name", "version"},
     "machine": {"platform", "cpu_count", "load_avg": [1, 5, 15 min], "device": str,
                 "peak_bandwidth_bytes_per_s": float | null},
     "settings": {"n_ctx", "threads", "n_batch", "n_ubatch", "gen_tokens", "repeats",
                  "prompt_lengths": [...], "depths": [...], "lookup": bool},
     "runs": [{"type_k", "type_v", "flash_attn": bool | null,
               "memory": {"weights", "kv", "compute", ...}, "kv_token_bytes": int,
               "peak_rss_bytes": int,
               "prefill": [{"tokens", "seconds", "tok_s"}],        # best of `repeats`
               "decode": [{"depth", "tokens", "seconds", "tok_s", "ttft_s", "itl_p50_s",
                           "itl_p95_s", "read_bytes_per_token", "achieved_bytes_per_s",
                           "bandwidth_fraction": float | null}],
               "lookup": {"tokens", "tok_s", "plain_tok_s", "acceptance", "tokens_per_round",
                          "verify_cost_s": [T(1), T(2), ...] | null, "bound": float | null} | null}],
     "batch_scaling": null | {"type_k", "type_v", "flash_attn", "kv_unified": bool, "gen_tokens",
                              "weight_read_bytes": D_w, "kv_token_bytes": k,
                              "rows": [{"batch", "depth", "tokens", "decode_tokens", "decode_steps",
                                        "prefill_s", "decode_s", "tok_s", "request_tok_s", "vs_batch1",
                                        "mean_context", "formula_bytes_per_token", "engine_bytes_per_token",
                                        "achieved_bytes_per_s", "bandwidth_fraction", "step_overhead"}]}}

Times are seconds, sizes bytes, rates per second.  ``decode[].seconds`` is the
sum of the ITLs (the first token is in ``ttft_s``), so ``tok_s = (tokens-1)/seconds``.
In ``batch_scaling.rows`` the first step prefills every prompt (and yields each
request's first token); ``decode_s`` spans the ``decode_steps`` steps after it,
engine work included, so ``tok_s = decode_tokens/decode_s`` (all requests) and
``request_tok_s`` is one request's mean rate.  ``formula_bytes_per_token`` is
d(b, L̄) at the decode tokens' mean context L̄ (keys attended: depth + gen/2);
``engine_bytes_per_token`` sums D_w(b) + Σ L_i·k over the steps the engine ran,
per output token (equal to the formula when every step holds all b requests);
``achieved_bytes_per_s = engine_bytes_per_token × tok_s``; ``step_overhead`` is
the share of ``decode_s`` spent outside the executor's step.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams
from localinfer.util.stats import percentile

SCHEMA, VERSION = "localinfer.generation.bench", 2
KV_TYPES = ("f16", "q8_0", "q4_0")
PROMPT_LENGTHS = (128, 512, 2048)
DEPTHS = (0, 512, 2048)
GEN_TOKENS = 32
BATCH_SIZES = (1, 2, 4, 8)   # the --batch-sizes the docs use; bench measures none unless asked
LOOKUP_PROMPT = 256  # tokens of self-repeating text the lookup comparison starts from
_FILLER = ("The quick brown fox jumps over the lazy dog while seven wizards quietly judge the boxing match; "
           "meanwhile engineers measure latency, bandwidth and memory on every machine they own. ")


@dataclass
class BenchConfig:
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS
    depths: tuple[int, ...] = DEPTHS
    gen_tokens: int = GEN_TOKENS
    kv_types: tuple[str, ...] = KV_TYPES
    repeats: int = 1
    lookup: bool = False

    @property
    def n_ctx_needed(self) -> int:
        depths = [*self.depths, LOOKUP_PROMPT] if self.lookup else self.depths
        longest = max([*self.prompt_lengths, *(d + self.gen_tokens + 1 for d in depths)])
        return -(-longest // 256) * 256


@dataclass
class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    total: int
    done: int = 0
    out: object = field(default=sys.stderr)

    def step(self, label: str) -> None:
        self.done += 1
        tty = hasattr(self.out, "isatty") and self.out.isatty()
        width = 24
        fill = width * self.done // max(self.total, 1)
        line = f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {label}"
        self.out.write(("\r\x1b[K" + line) if tty else line + "\n")
        if tty and self.done >= self.total:
            self.out.write("\n")
        self.out.flush()


def prompt_of(engine, n: int) -> list[int]:
    """n deterministic prompt tokens of ordinary text."""
    base = engine.tokenize(_FILLER * 4)
    reps = -(-n // len(base))
    return (base * reps)[:n] or base[:1]


def peak_rss() -> int:
    """Peak resident memory of this process in bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def measure_prefill(engine, n: int, repeats: int) -> dict:
    tokens = prompt_of(engine, n)
    best = float("inf")
    for _ in range(repeats):
        engine.trim(0)
        t0 = time.perf_counter()
        engine.eval(tokens, logits_at=[-1])
        best = min(best, time.perf_counter() - t0)
    engine.trim(0)
    return {"tokens": n, "seconds": best, "tok_s": n / best}


def measure_decode(runner: Runner, depth: int, gen: int, decoder=None):
    """(figures, the Generation) of a greedy run of ``gen`` tokens after a ``depth``-token prompt."""
    engine = runner.engine
    runner.reset()
    prompt = prompt_of(engine, max(depth, 1))
    g = runner.generate(prompt, SamplingParams(temperature=0.0), max_tokens=gen, ignore_eos=True, decoder=decoder)
    tm = g.timings
    seconds = tm.decode_seconds
    out = {"depth": depth, "tokens": tm.generated, "seconds": seconds, "tok_s": tm.decode_tok_s,
           "ttft_s": tm.ttft, "itl_p50_s": percentile(tm.itl, 0.5), "itl_p95_s": percentile(tm.itl, 0.95)}
    runner.reset()
    return out, g


def run_bench(model_path: str, load: Callable[[str, str, int], object], config: BenchConfig, *,
              progress: Progress | None = None, peak_bandwidth: float | None = None, spec=None) -> list[dict]:
    """Measure every KV type; ``load(type_k, type_v, n_ctx)`` returns a loaded engine.  ``spec``: the model's
    ModelSpec when the caller has read the header already (else it is read here)."""
    from localinfer.model.cost import model_cost
    from localinfer.model.spec import ModelSpec

    cost = model_cost(spec if spec is not None else ModelSpec.from_gguf(model_path))
    runs = []
    for kv in config.kv_types:
        engine = load(kv, kv, config.n_ctx_needed)
        with engine:
            runner = Runner(engine)
            engine.eval(prompt_of(engine, 8), logits_at=[-1])  # warm up
            engine.trim(0)
            run = {"type_k": kv, "type_v": kv, "flash_attn": engine.plan.flash_attn, "memory": engine.memory(),
                   "kv_token_bytes": cost.kv_token_bytes(kv), "prefill": [], "decode": [], "lookup": None}
            for n in config.prompt_lengths:
                run["prefill"].append(measure_prefill(engine, n, config.repeats))
                if progress:
                    progress.step(f"{kv} prefill {n}")
            for d in config.depths:
                best = None
                for _ in range(config.repeats):
                    m, _ = measure_decode(runner, d, config.gen_tokens)
                    if best is None or (m["tok_s"] or 0) > (best["tok_s"] or 0):
                        best = m
                read = cost.decode_read_bytes(1) + cost.kv_read_bytes(max(d, 1) + config.gen_tokens // 2, kv)
                best["read_bytes_per_token"] = read
                best["achieved_bytes_per_s"] = read * best["tok_s"] if best["tok_s"] else None
                best["bandwidth_fraction"] = (best["achieved_bytes_per_s"] / peak_bandwidth
                                              if peak_bandwidth and best["achieved_bytes_per_s"] else None)
                run["decode"].append(best)
                if progress:
                    progress.step(f"{kv} decode @{d}")
            if config.lookup:
                run["lookup"] = measure_lookup(runner, config.gen_tokens)
                if progress:
                    progress.step(f"{kv} lookup")
            run["peak_rss_bytes"] = peak_rss()
        runs.append(run)
    return runs


def measure_lookup(runner: Runner, gen: int) -> dict:
    """Prompt-lookup decoding against plain decoding on a prompt that repeats itself.

    ``bound`` is the speedup a clairvoyant drafter would reach on plain's
    output at the verify cost this run measured (``clairvoyant_time``): what
    any prompt-lookup policy can reach on this engine and machine.
    """
    from localinfer.generation.lookup import LookupDecoder
    from localinfer.plan.speculation import clairvoyant_speedup

    plain, g = measure_decode(runner, LOOKUP_PROMPT, gen)
    decoder = LookupDecoder()
    spec, lk = measure_decode(runner, LOOKUP_PROMPT, gen, decoder=decoder)
    stats, curve, bound = lk.stats, decoder.cost.curve(), None
    drafted = curve and any(decoder.cost.measured(m) for m in range(2, len(curve) + 1))
    if drafted and len(g.tokens) > 1:  # a curve measured only at T(1) would rest on the prior slope
        bound = clairvoyant_speedup(prompt_of(runner.engine, LOOKUP_PROMPT) + g.tokens[:1], g.tokens[1:], curve)
    return {"tokens": spec["tokens"], "tok_s": spec["tok_s"], "plain_tok_s": plain["tok_s"],
            "acceptance": stats.acceptance, "tokens_per_round": stats.tokens_per_round,
            "verify_cost_s": curve, "bound": bound}


def step_read_bytes(cost, contexts: Sequence[float], kv: str = "f16") -> float:
    """D(b, ·) of one decode step whose b requests attend ``contexts`` keys each: D_w(b) + Σ L_i·k."""
    return cost.decode_read_bytes(len(contexts)) + sum(cost.kv_read_bytes(c, kv) for c in contexts)


def batch_row(cost, kv: str, *, batch: int, depth: int, tokens: int, decode_steps: Sequence[Sequence[int]],
              prefill_s: float, decode_s: float, executor_s: float, request_tok_s: float | None,
              peak_bandwidth: float | None = None) -> dict:
    """One batch-scaling row from what the engine ran.

    ``decode_steps`` lists, per decode step, the keys each of its requests
    attended (position + 1); ``tokens`` counts every output token, prefill's
    first ones included.  Bytes read are the model's (docs/speed.md), never a
    hardware counter: the formula d(b, L̄) = D_w/b + L̄·k at the mean context,
    and the same terms summed over the steps actually taken.
    """
    contexts = [c for step in decode_steps for c in step]
    n = len(contexts)
    mean_ctx = sum(contexts) / n if n else float(depth)
    engine = sum(step_read_bytes(cost, step, kv) for step in decode_steps) / n if n else None
    tok_s = n / decode_s if n and decode_s > 0 else None
    achieved = engine * tok_s if engine is not None and tok_s else None
    return {"batch": batch, "depth": depth, "tokens": tokens, "decode_tokens": n, "decode_steps": len(decode_steps),
            "prefill_s": prefill_s, "decode_s": decode_s, "tok_s": tok_s, "request_tok_s": request_tok_s,
            "vs_batch1": None, "mean_context": mean_ctx,
            "formula_bytes_per_token": cost.per_token_read_bytes(batch, mean_ctx, kv),
            "engine_bytes_per_token": engine, "achieved_bytes_per_s": achieved,
            "bandwidth_fraction": achieved / peak_bandwidth if achieved and peak_bandwidth else None,
            "step_overhead": 1 - executor_s / decode_s if decode_s > 0 else None}


def batch_section(cost, rows: list[dict], *, kv: str, flash_attn: bool | None, kv_unified: bool,
                  gen_tokens: int) -> dict:
    """The ``batch_scaling`` document: rows with ``vs_batch1`` (tok/s against batch 1 at the same depth)."""
    base = {r["depth"]: r["tok_s"] for r in rows if r["batch"] == 1}
    for r in rows:
        b1 = base.get(r["depth"])
        r["vs_batch1"] = r["tok_s"] / b1 if b1 and r["tok_s"] else None
    return {"type_k": kv, "type_v": kv, "flash_attn": flash_attn, "kv_unified": kv_unified,
            "gen_tokens": gen_tokens, "weight_read_bytes": cost.decode_read_bytes(1),
            "kv_token_bytes": cost.kv_token_bytes(kv), "rows": rows}


def render_batch(section: dict) -> list[str]:
    """The batch-scaling table: measured tok/s beside d(b, L̄) and the bandwidth it implies."""
    layout = "one KV pool" if section["kv_unified"] else "a KV stream per request"
    title = (f"batch scaling (KV {section['type_k']}, {section['gen_tokens']} tokens per request, {layout}): "
             f"d(b, L) = D_w/b + L·k, D_w {section['weight_read_bytes'] / 1e6:.1f} MB, "
             f"k {section['kv_token_bytes'] / 1e3:.1f} KB/token")
    head = (f"{'':<2}{'batch':>5}{'depth':>7}{'tok/s':>9}{'per req':>9}{'vs b=1':>8}{'L mean':>8}"
            f"{'MB/tok d(b,L)':>15}{'engine':>8}{'GB/s':>8}{'of peak':>9}{'overhead':>9}")
    lines = [title, head]
    for r in section["rows"]:
        frac, ach, eng, over = (r["bandwidth_fraction"], r["achieved_bytes_per_s"], r["engine_bytes_per_token"],
                                r["step_overhead"])
        lines.append(f"{'':<2}{r['batch']:>5}{r['depth']:>7}{_num(r['tok_s'], 9, 1)}{_num(r['request_tok_s'], 9, 1)}"
                     f"{_times(r['vs_batch1'])}{r['mean_context']:>8.0f}"
                     f"{r['formula_bytes_per_token'] / 1e6:>15.2f}{_num(eng / 1e6 if eng else None, 8, 2)}"
                     f"{_num(ach / 1e9 if ach else None, 8, 2)}{(f'{frac * 100:8.1f}%' if frac else '        -')}"
                     f"{(f'{over * 100:8.1f}%' if over is not None else '        -')}")
    return lines


def results(model_path: str, spec, backend: str, backend_version: str, settings: dict, runs: list[dict],
            device_name: str, peak_bandwidth: float | None, batch_scaling: dict | None = None) -> dict:
    """The versioned JSON document."""
    from localinfer import __version__
    from localinfer.model.cost import model_cost

    cost = model_cost(spec)
    return {
        "schema": SCHEMA, "version": VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "localinfer": __version__,
        "model": {"path": str(model_path), "name": spec.name, "arch": spec.arch, "file_size": spec.file_size,
                  "weight_bytes": spec.weight_bytes, "decode_read_bytes": cost.decode_read_bytes(1),
                  "n_params": spec.n_params},
        "backend": {"name": backend, "version": backend_version},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                    "device": device_name, "peak_bandwidth_bytes_per_s": peak_bandwidth},
        "settings": settings, "runs": runs, "batch_scaling": batch_scaling,
    }


def render_table(doc: dict) -> str:
    """The results as aligned text tables."""
    runs = doc["runs"]
    from gguf_tools.inspect import safe_text

    title = (f"{safe_text(doc['model']['name'], 80)} on {doc['backend']['name']} ({doc['machine']['device']}), "
             f"{doc['settings']['threads']} threads")
    lines = [title]
    lengths = doc["settings"]["prompt_lengths"]
    lines.append("")
    lines.append("prefill tok/s  " + "".join(f"{n:>10}" for n in lengths))
    for r in runs:
        lines.append(f"  KV {r['type_k']:<9}  " + "".join(f"{p['tok_s']:>10.1f}" for p in r["prefill"]))
    lines.append("")
    head = f"{'decode':<16}{'depth':>6}{'tok/s':>9}{'TTFT ms':>9}{'ITL p50':>9}{'ITL p95':>9}{'GB/s':>8}{'of peak':>9}"
    lines.append(head)
    for r in runs:
        for d in r["decode"]:
            frac = d["bandwidth_fraction"]
            gbs = d["achieved_bytes_per_s"]
            lines.append(f"  KV {r['type_k']:<11}{d['depth']:>6}{_num(d['tok_s'], 9, 1)}{_num(_milli(d['ttft_s']), 9, 1)}"
                         f"{_num(_milli(d['itl_p50_s']), 9, 1)}{_num(_milli(d['itl_p95_s']), 9, 1)}"
                         f"{_num(gbs / 1e9 if gbs else None, 8, 2)}{(f'{frac * 100:8.1f}%' if frac else '       -')}")
    lines.append("")
    lines.append(f"{'memory MiB':<16}{'weights':>9}{'KV':>9}{'compute':>9}{'peak RSS':>10}")
    for r in runs:
        m = r["memory"]
        lines.append(f"  KV {r['type_k']:<11}{m.get('weights', 0) / 2**20:>9.1f}{m.get('kv', 0) / 2**20:>9.1f}"
                     f"{m.get('compute', 0) / 2**20:>9.1f}{r['peak_rss_bytes'] / 2**20:>10.1f}")
    for r in runs:
        lk = r.get("lookup")
        if lk:
            lines.append(f"lookup KV {r['type_k']}: {_num(lk['tok_s'], 0, 1).strip()} tok/s vs plain "
                         f"{_num(lk['plain_tok_s'], 0, 1).strip()}, {lk['tokens_per_round']:.2f} tok/round, "
                         f"{lk['acceptance'] * 100:.0f}% accepted"
                         + (f"; a clairvoyant drafter would reach {lk['bound']:.2f}x at this verify cost"
                            if lk.get("bound") else ""))
    if doc.get("batch_scaling"):
        lines += ["", *render_batch(doc["batch_scaling"])]
    return "\n".join(lines)


def _num(v, w, prec) -> str:
    return f"{v:>{w}.{prec}f}" if v is not None else f"{'-':>{w}}"


def _milli(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _times(ratio: float | None) -> str:
    return f"{ratio:7.2f}x" if ratio else f"{'-':>8}"
