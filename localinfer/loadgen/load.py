"""Load test any OpenAI-compatible server: closed-loop concurrency levels and open-loop Poisson arrivals.

The code behind ``localinfer bench serve`` and ``benchmarks/serve_load.py``.  Every request is a streaming
``/v1/completions`` of ``output_tokens`` tokens with EOS ignored (``ignore_eos``, which llama-server and vLLM
also read) on a prompt of about ``prompt_tokens`` tokens (seeded random common words, one token each in most
BPE vocabularies); ``shared_prefix = N`` starts every prompt with the same N-word block, as a system prompt
would.  Per request: TTFT (request sent to first text), ITL (gaps between text chunks), end-to-end time,
output tokens (``usage.completion_tokens`` when the server sends ``stream_options.include_usage``, else text
chunks) and the prompt tokens it reports cached (``usage.prompt_tokens_details.cached_tokens``).  Idle
kept-alive connections are let go after ``KEEPALIVE_S``, before the 5 s after which llama-server's HTTP
library and uvicorn close them (httpx's own default is also 5 s: a request sent on a connection the server
is closing meets "Server disconnected without sending a response").  A request whose connection closes
within ``RESEND_WITHIN_S`` of sending and before any byte of answer (too soon for a server to have worked on
it) is sent once more, timed from its first send, and counted in ``resent``; a later or second such close,
or one mid-answer, fails it.

Per run: TTFT / ITL / e2e p50, p95, p99, ITL p99.9, the largest gap overall and each request's largest; output tokens/s and requests/s over the makespan; goodput, vLLM's
``--goodput`` definition: requests per second that finished correctly (HTTP 200, the whole output) with
TTFT ≤ ``slo_ttft`` and e2e ≤ ``slo_e2e``.  Closed loop: ``c`` workers, each sending its next request when
the last one ends, ``requests`` in all.  Open loop: arrivals at exponential gaps of mean 1/rate, whatever
the server does.  ``deadline_ms`` sends a per-request deadline that localinfer's deadline-aware admission
uses (refused requests count as not good).  Each run gets fresh prompts, so a cache of the last run cannot
answer.

While a run goes, the server is polled every ``poll_s`` seconds next to the base URL (the URL without its
``/v1``), and ``runs[*].peaks`` holds the largest value seen of:

- ``localinfer_kv_blocks_used`` (``/metrics``) × 16 tokens per block: an upper bound on localinfer's KV cells;
- ``localinfer_requests_running`` (``/metrics``): requests holding a slot;
- ``llamacpp:kv_cache_tokens`` and ``llamacpp:requests_processing`` (``/metrics``): llama-server's gauges,
  exported only by versions that have them and only with ``--metrics``;
- ``llama_server_slot_tokens`` (``GET /slots``, when it answers 200 with a list): Σ over the slots with
  ``is_processing`` of ``n_prompt_tokens + next_token[0].n_decoded``, the cells llama-server's busy slots
  hold (the versions without a KV gauge).

``runs[*].engine`` is how much localinfer's step counters grew (time in executor steps and in llama_decode).
Errors are typed: a bad setting is a :class:`~localinfer.errors.UsageError` naming the flag, a server that
cannot be reached or answers outside the OpenAI shape a :class:`~localinfer.errors.RemoteServerError`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import platform
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from localinfer.errors import BackendUnavailableError, RemoteServerError, UsageError
from localinfer.loadgen.peaks import SLOT_PEAK, PeakWatcher
from localinfer.util.stats import percentile

try:
    import httpx
except ImportError:  # an optional dependency: refused with a hint when a load test starts
    httpx = None

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her",
         "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will",
         "more", "out", "up", "into", "do", "any", "your", "what", "some", "can", "other", "than", "then", "its",
         "only", "time", "new", "about", "two", "may", "first", "also", "after", "like", "these", "could", "made",
         "over"]
KEEPALIVE_S = 2.0          # idle kept-alive connections closed by the client first
RESEND_WITHIN_S = 0.05     # a hang-up this soon after sending, with nothing received, is a stale connection
MAX_CONCURRENCY = 4096
MAX_COUNT = 1 << 20
Progress = Callable[[str, int, int], None]    # (run label, requests done, requests in the run)


@dataclass(frozen=True)
class LoadConfig:
    """What to send and how to judge it; fields are the flags of ``bench serve`` (``--prompt-tokens`` ...)."""

    concurrency: tuple[int, ...] = (1, 4, 8)
    rate: tuple[float, ...] = ()
    requests: int = 16
    prompt_tokens: int = 300
    output_tokens: int = 128
    shared_prefix: int = 0
    slo_ttft: float = 10.0
    slo_e2e: float = 10.0
    deadline_ms: float | None = None
    timeout: float = 600.0
    seed: int = 0
    model_name: str | None = None
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)
    poll_s: float = 0.2

    def __post_init__(self):
        object.__setattr__(self, "concurrency", tuple(self.concurrency))
        object.__setattr__(self, "rate", tuple(self.rate))
        _check(self)

    def settings(self) -> dict:
        """The settings for the JSON (never the API key)."""
        return {k: v for k, v in asdict(self).items() if k != "api_key"}


def _check(c: LoadConfig) -> None:
    if not c.concurrency and not c.rate:
        raise UsageError("nothing to run: --concurrency and --rate are both empty", flag="--concurrency",
                         hint="e.g. --concurrency 1,4,8 or --rate 0.5,1")
    for n in c.concurrency:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CONCURRENCY:
            raise UsageError(f"--concurrency {n} is out of range", flag="--concurrency",
                             hint=f"use whole numbers in 1..{MAX_CONCURRENCY}")
    for r in c.rate:
        if not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise UsageError(f"--rate {r} is not a positive number of requests per second", flag="--rate",
                             hint="e.g. --rate 0.5,1")
    for flag, v, lo in (("--requests", c.requests, 1), ("--prompt-tokens", c.prompt_tokens, 1),
                        ("--output-tokens", c.output_tokens, 1), ("--shared-prefix", c.shared_prefix, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_COUNT:
            raise UsageError(f"{flag} {v} is out of range", flag=flag, hint=f"use {lo}..{MAX_COUNT}")
    for flag, v in (("--slo-ttft", c.slo_ttft), ("--slo-e2e", c.slo_e2e), ("--timeout", c.timeout),
                    ("--deadline-ms", c.deadline_ms), ("poll_s", c.poll_s)):
        if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise UsageError(f"{flag} {v} must be a positive number", flag=flag)
    if not isinstance(c.extra_body, dict):
        raise UsageError("--extra-body must be a JSON object", flag="--extra-body", hint='e.g. {"min_tokens": 128}')


def check_url(url: str) -> str:
    """The base URL without a trailing slash; UsageError when it is not an http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a port out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or any(
            ch.isspace() or ord(ch) < 32 for ch in url):
        raise UsageError(f"--url {url} is not an http(s) URL", flag="--url",
                         hint="give the server's OpenAI base URL, e.g. --url http://127.0.0.1:8080/v1")
    return url.rstrip("/")


def server_root(base: str) -> str:
    """Where /metrics, /slots and /health live: the base URL without its /v1."""
    return re.sub(r"/v1$", "", base)


@dataclass
class Result:
    """One request: ``ok`` when it answered 200 and streamed at least ``output_tokens`` tokens."""

    ok: bool
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    resent: bool = False       # its first send met a kept-alive connection the server had closed



def prompts(n: int, words: int, shared: int, seed: int) -> list[str]:
    """``n`` seeded prompts of about ``words`` words, the first ``shared`` of them the same in every prompt."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(shared))
    out = []
    for i in range(n):
        own = " ".join(rng.choice(WORDS) for _ in range(max(1, words - shared)))
        out.append((prefix + " " if prefix else "") + f"{i}: " + own)
    return out


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


async def one(client, config: LoadConfig, model: str, prompt: str) -> Result:
    """Send one streaming completion and time it; transport and protocol faults become a failed Result."""
    body = {**config.extra_body, "model": model, "prompt": prompt, "max_tokens": config.output_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {}
    if config.deadline_ms:
        body["deadline_ms"] = config.deadline_ms
        headers["x-localinfer-deadline-ms"] = str(config.deadline_ms)
    t0 = time.perf_counter()
    times, usage, resent = [], None, False
    try:
        async with asyncio.timeout(config.timeout):      # the whole request: httpx's timeout is per read
            done = await _send(client, body, headers, t0, times)
    except TimeoutError:
        return Result(False, 0, error=f"no complete reply within --timeout {config.timeout:g} s",
                      resent=False)
    if isinstance(done, Result):
        return done
    usage, resent = done
    end = time.perf_counter()
    usage = usage or {}
    n = usage["completion_tokens"] if _count(usage.get("completion_tokens")) else len(times)
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Result(bool(times) and n >= config.output_tokens, 200, times[0] - t0 if times else None, end - t0, n,
                  [b - a for a, b in itertools.pairwise(times)], prompt_tokens=_count(usage.get("prompt_tokens")),
                  cached_tokens=cached, resent=resent)


async def _send(client, body: dict, headers: dict, t0: float, times: list):
    """Stream one completion, appending each text chunk's arrival to ``times``: (usage, resent), or a failed
    Result."""
    usage, resent = None, False
    for attempt in range(2):
        answered = False
        try:
            async with client.stream("POST", "/completions", json=body, headers=headers) as r:
                answered = True
                if r.status_code != 200:
                    return Result(False, r.status_code, error=(await r.aread()).decode(errors="replace")[:200],
                                  resent=resent)
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if not isinstance(ev, dict):
                        continue
                    if isinstance(ev.get("usage"), dict):
                        usage = ev["usage"]
                    if any(isinstance(c, dict) and c.get("text") for c in ev.get("choices") or []):
                        times.append(time.perf_counter())
            break
        except httpx.RemoteProtocolError as exc:
            # a kept-alive connection the server closed as this request went out: nothing came back, too soon
            # for any work on it, so it is sent once more, timed from the first send
            if answered or attempt or time.perf_counter() - t0 > RESEND_WITHIN_S:
                return Result(False, 0, error=f"{type(exc).__name__}: {exc}", resent=resent)
            resent = True
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return Result(False, 0, error=f"{type(exc).__name__}: {exc}", resent=resent)
    return usage, resent


def is_good(r: Result, slo_ttft: float, slo_e2e: float) -> bool:
    """vLLM's goodput test: finished correctly, TTFT within ``slo_ttft`` s and end-to-end within ``slo_e2e`` s."""
    return r.ok and r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= slo_ttft and r.e2e_s <= slo_e2e


def summarise(results: list[Result], makespan: float, slo_ttft: float, slo_e2e: float) -> dict:
    """One run's figures: counts, rates over ``makespan`` seconds, goodput, TTFT/ITL/e2e percentiles in ms."""
    ms = lambda v: None if v is None else round(v * 1e3, 1)
    span = max(makespan, 1e-9)
    good = sum(is_good(r, slo_ttft, slo_e2e) for r in results)
    ok = sum(r.ok for r in results)
    tokens = sum(r.output_tokens for r in results)
    out = {"requests": len(results), "ok": ok, "makespan_s": round(makespan, 3), "output_tokens": tokens,
           "output_tok_s": round(tokens / span, 2), "requests_s": round(ok / span, 4),
           "goodput_req_s": round(good / span, 4), "good": good,
           "prompt_tokens": sum(r.prompt_tokens for r in results),
           "cached_tokens": sum(r.cached_tokens for r in results),
           "resent": sum(r.resent for r in results),
           "errors": sorted({f"{r.status} {r.error}" for r in results if not r.ok})[:5]}
    gaps = [g for r in results for g in r.gaps_s]
    for name, xs in (("ttft", [r.ttft_s for r in results if r.ttft_s is not None]),
                     ("itl", gaps),
                     ("e2e", [r.e2e_s for r in results if r.ok])):
        for q in (50, 95, 99):
            out[f"{name}_p{q}_ms"] = ms(percentile(xs, q / 100))
    # a stream that freezes: the slowest 0.1% of gaps, the largest one, and each request's largest
    largest = [max(r.gaps_s) for r in results if r.gaps_s]
    out["itl_p99.9_ms"] = ms(percentile(gaps, 0.999))
    out["gap_max_ms"] = ms(max(gaps, default=None))
    out["request_gap_p50_ms"] = ms(percentile(largest, 0.5))
    out["request_gap_p95_ms"] = ms(percentile(largest, 0.95))
    out["request_gaps_ms"] = [ms(g) for g in largest]
    return out


def _ticker(progress: Progress | None, label: str, total: int) -> Callable[[], None]:
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(label, done, total)
    return tick


async def closed_loop(client, config: LoadConfig, model: str, root: str, texts: list[str], concurrency: int,
                      progress: Progress | None = None) -> dict:
    """``concurrency`` workers, each sending its next prompt when its last request ends."""
    queue = list(texts)
    results: list[Result] = []
    tick = _ticker(progress, f"concurrency {concurrency}", len(texts))

    async def worker():
        while queue:
            results.append(await one(client, config, model, queue.pop(0)))
            tick()

    async with PeakWatcher(client, root, config.poll_s) as peaks:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        makespan = time.perf_counter() - t0
    return {"mode": "closed", "concurrency": concurrency,
            **summarise(results, makespan, config.slo_ttft, config.slo_e2e), "peaks": peaks.peaks,
            "engine": peaks.grown()}


async def open_loop(client, config: LoadConfig, model: str, root: str, texts: list[str], rate: float,
                    progress: Progress | None = None) -> dict:
    """Poisson arrivals at ``rate`` requests/s (seeded exponential gaps), whatever the server does."""
    rng = random.Random(config.seed)
    tick = _ticker(progress, f"rate {rate:g}/s", len(texts))

    async def later(delay, text):
        await asyncio.sleep(delay)
        r = await one(client, config, model, text)
        tick()
        return r

    at, tasks = 0.0, []
    async with PeakWatcher(client, root, config.poll_s) as peaks:
        t0 = time.perf_counter()
        for text in texts:
            tasks.append(asyncio.ensure_future(later(at, text)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - t0
    return {"mode": "open", "rate_req_s": rate,
            **summarise(list(results), makespan, config.slo_ttft, config.slo_e2e), "peaks": peaks.peaks,
            "engine": peaks.grown()}


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


async def _model(client, base: str, config: LoadConfig) -> str:
    """The model to name: ``model_name``, else the first of ``/models``; RemoteServerError when unreachable."""
    try:
        r = await client.get("/models", timeout=min(config.timeout, 30.0))
    except httpx.HTTPError as exc:
        raise RemoteServerError(f"cannot reach {base}/models ({_reason(exc)})", url=base,
                                hint="start the server first, or fix --url (the OpenAI base URL, e.g. "
                                     "http://127.0.0.1:8080/v1)") from None
    if config.model_name:
        return config.model_name
    if r.status_code != 200:
        raise RemoteServerError(f"GET {base}/models answered HTTP {r.status_code}", url=base, status=r.status_code,
                                hint="check --url (the base URL ends in /v1) and --api-key, or pass --model-name")
    try:
        name = r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        name = None
    if not isinstance(name, str) or not name:
        raise RemoteServerError(f"GET {base}/models lists no model (data[0].id is missing)", url=base,
                                hint="pass the model's name with --model-name NAME")
    return name


async def measure(url: str, config: LoadConfig, progress: Progress | None = None) -> dict:
    """Every closed-loop level, then every open-loop rate, after one uncounted warm-up: ``{"model", "runs"}``."""
    if httpx is None:
        raise BackendUnavailableError("load testing a server needs the httpx package", hint="pip install httpx")
    base = check_url(url)
    root = server_root(base)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    most = max(256, *config.concurrency) if config.concurrency else 256
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=config.timeout, limits=limits) as client:
        model = await _model(client, base, config)

        def texts(i: int) -> list[str]:   # fresh prompts per run: a server's cache of the last run must not answer
            return prompts(config.requests, config.prompt_tokens, config.shared_prefix, config.seed + 1000 * i)

        warm = await one(client, config, model, "warm-up: " + " ".join(WORDS[:20]))   # shares no prefix
        if warm.status != 200:
            detail = f"HTTP {warm.status}: " if warm.status else ""
            raise RemoteServerError(f"the warm-up request to {base}/completions failed ({detail}{warm.error})",
                                    url=base, status=warm.status,
                                    hint="check --model-name and --api-key; the server must stream /v1/completions")
        runs = []
        for i, c in enumerate(config.concurrency):
            runs.append(await closed_loop(client, config, model, root, texts(i), c, progress))
        for i, r in enumerate(config.rate):
            runs.append(await open_loop(client, config, model, root, texts(len(config.concurrency) + i), r, progress))
    return {"model": model, "runs": runs}


def run_load(url: str, config: LoadConfig, progress: Progress | None = None) -> dict:
    """:func:`measure` on a fresh event loop."""
    return asyncio.run(measure(url, config, progress))


def machine() -> dict:
    """The CPU, cores, Python, OS and load average: the JSON notes the machine every figure came from."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform(),
            "loadavg_1_5_15": loadavg()}


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def document(server: str, measured: dict, settings: dict, load_before: list[float] | None = None) -> dict:
    """The JSON a load test writes: ``server``, ``machine``, ``settings``, ``model``, ``runs``, ``when``."""
    return {"server": server, "machine": dict(machine(), loadavg_before=load_before), "settings": settings,
            **measured, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def render_table(doc: dict) -> str:
    """One line per run: output tok/s, req/s, goodput, TTFT / ITL / e2e percentiles (s, ms), ok count, peak cells."""
    sec = lambda v: "-" if v is None else f"{v / 1e3:.2f}s"
    head = (f"{'run':>10} {'tok/s':>8} {'req/s':>7} {'good/s':>7} {'TTFT p50':>9} {'p95':>7} {'ITL p50':>8} "
            f"{'p99':>7} {'max gap':>8} {'e2e p50':>8} {'p95':>7} {'ok':>7} {'peak cells':>10}")
    lines = [f"{doc.get('server')}  model {doc.get('model')}", head]
    for r in doc["runs"]:
        key = f"c={r['concurrency']}" if r["mode"] == "closed" else f"rate={r['rate_req_s']:g}"
        p = r.get("peaks", {})
        cells = p.get("localinfer_kv_blocks_used") or p.get(SLOT_PEAK) or p.get("llamacpp:kv_cache_tokens")
        ok = f"{r['ok']}/{r['requests']}"
        itl = "-" if r["itl_p50_ms"] is None else f"{r['itl_p50_ms']:.1f}ms"
        tail = "-" if r.get("itl_p99_ms") is None else f"{r['itl_p99_ms']:.0f}ms"
        gap = "-" if r.get("gap_max_ms") is None else f"{r['gap_max_ms']:.0f}ms"
        lines.append(f"{key:>10} {r['output_tok_s']:>8.2f} {r['requests_s']:>7.3f} {r['goodput_req_s']:>7.3f} "
                     f"{sec(r['ttft_p50_ms']):>9} {sec(r['ttft_p95_ms']):>7} {itl:>8} {tail:>7} {gap:>8} "
                     f"{sec(r['e2e_p50_ms']):>8} "
                     f"{sec(r['e2e_p95_ms']):>7} {ok:>7} {'-' if not cells else int(cells):>10}")
    return "\n".join(lines)


class ProgressBar:
    """A :data:`Progress` callback drawing one bar per run on a text stream (stderr by default)."""

    def __init__(self, stream=None):
        self.stream = stream

    def __call__(self, label: str, done: int, total: int) -> None:
        import sys

        stream = self.stream or sys.stderr
        bar = "#" * (30 * done // max(total, 1))
        print(f"\r{label:>14} [{bar:<30}] {done}/{total}", end="", file=stream, flush=True)
        if done >= total:
            print(file=stream, flush=True)
