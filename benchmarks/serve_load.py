"""Load test any OpenAI-compatible server: closed-loop concurrency levels and open-loop Poisson arrivals.

    python benchmarks/serve_load.py --url http://127.0.0.1:8080/v1 [--concurrency 1,4,8] [--rate 0.5,1]
    python benchmarks/serve_load.py MODEL.gguf --threads 2 --ctx 4096 --parallel 8     # starts localinfer serve

Every request is a streaming ``/v1/completions`` of ``--output-tokens`` tokens with EOS ignored
(``ignore_eos``, which llama-server and vLLM also read) on a prompt of about ``--prompt-tokens``
tokens (seeded random common words, one token each in most BPE vocabularies); ``--shared-prefix N``
starts every prompt with the same N-word block, as a system prompt would.  Per request: TTFT
(request sent to first text), ITL (gaps between text chunks), end-to-end time, output tokens
(``usage.completion_tokens`` when the server sends ``stream_options.include_usage``, else text chunks).

While a run goes, ``/metrics`` (next to the base URL) is polled every 0.2 s for the peak of the KV
gauges both servers export: ``localinfer_kv_blocks_used`` (× 16 tokens: an upper bound on cells) and
llama-server's ``llamacpp:kv_cache_tokens`` (absent unless it runs with ``--metrics``).

Per run: TTFT / ITL / e2e p50, p95, p99; output tokens/s and requests/s over the makespan; goodput,
vLLM's ``--goodput`` definition: requests per second that finished correctly (HTTP 200, the whole
output) with TTFT ≤ ``--slo-ttft`` and e2e ≤ ``--slo-e2e``.  Closed loop: ``c`` workers, each sending
its next request when the last one ends, ``--requests`` in all.  Open loop: arrivals at exponential
gaps of mean 1/rate, whatever the server does.  ``--deadline-ms`` sends a per-request deadline that
localinfer's deadline-aware admission uses (refused requests count as not good).  JSON (``--out``)
carries the machine and every setting.
Only 127.0.0.1 servers are expected here; the URL is whatever you give.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from localinfer.util.stats import percentile

WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her",
         "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will",
         "more", "out", "up", "into", "do", "any", "your", "what", "some", "can", "other", "than", "then", "its",
         "only", "time", "new", "about", "two", "may", "first", "also", "after", "like", "these", "could", "made",
         "over"]


@dataclass
class Result:
    ok: bool
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


def prompts(n: int, words: int, shared: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(shared))
    out = []
    for i in range(n):
        own = " ".join(rng.choice(WORDS) for _ in range(max(1, words - shared)))
        out.append((prefix + " " if prefix else "") + f"{i}: " + own)
    return out


async def one(client: httpx.AsyncClient, args, model: str, prompt: str) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {}
    if args.deadline_ms:
        body["deadline_ms"] = args.deadline_ms
        headers["x-localinfer-deadline-ms"] = str(args.deadline_ms)
    t0 = time.perf_counter()
    times, usage = [], None
    try:
        async with client.stream("POST", "/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return Result(False, r.status_code, error=(await r.aread()).decode(errors="replace")[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    usage = ev["usage"]
                if any(c.get("text") for c in ev.get("choices") or []):
                    times.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Result(False, 0, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    return Result(bool(times) and n >= args.output_tokens, 200, times[0] - t0 if times else None, end - t0, n,
                  [b - a for a, b in itertools.pairwise(times)])


def summarise(results: list[Result], makespan: float, args) -> dict:
    ms = lambda v: None if v is None else round(v * 1e3, 1)
    good = [r for r in results if r.ok and r.ttft_s <= args.slo_ttft and r.e2e_s <= args.slo_e2e]
    out = {"requests": len(results), "ok": sum(r.ok for r in results), "makespan_s": round(makespan, 3),
           "output_tokens": sum(r.output_tokens for r in results),
           "output_tok_s": round(sum(r.output_tokens for r in results) / makespan, 2),
           "requests_s": round(sum(r.ok for r in results) / makespan, 4),
           "goodput_req_s": round(len(good) / makespan, 4), "good": len(good),
           "errors": sorted({f"{r.status} {r.error}" for r in results if not r.ok})[:5]}
    for name, xs in (("ttft", [r.ttft_s for r in results if r.ttft_s is not None]),
                     ("itl", [g for r in results for g in r.gaps_s]),
                     ("e2e", [r.e2e_s for r in results if r.ok])):
        for q in (50, 95, 99):
            out[f"{name}_p{q}_ms"] = ms(percentile(xs, q / 100))
    return out


class Progress:
    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = total, 0, label

    def tick(self) -> None:
        self.done += 1
        bar = "#" * (30 * self.done // self.total)
        print(f"\r{self.label:>14} [{bar:<30}] {self.done}/{self.total}", end="", file=sys.stderr, flush=True)
        if self.done == self.total:
            print(file=sys.stderr)


PEAK_GAUGES = {"localinfer_kv_blocks_used": 16, "llamacpp:kv_cache_tokens": 1, "localinfer_requests_running": 1,
               "llamacpp:requests_processing": 1}


COUNTERS = ("localinfer_engine_step_seconds_total", "localinfer_engine_decode_seconds_total",
            "localinfer_engine_steps_total")


class PeakWatcher:
    """Polls /metrics while a run goes: the peak of each gauge in PEAK_GAUGES (scaled to tokens), and how
    much each of COUNTERS grew (localinfer: time in executor steps and inside llama_decode)."""

    def __init__(self, client: httpx.AsyncClient, url: str):
        self.client, self.url, self.peaks = client, url, {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.task = None

    async def _poll(self):
        while True:
            await self.sample()
            await asyncio.sleep(0.2)

    async def sample(self):
        try:
            text = (await self.client.get(self.url, timeout=5)).text
        except httpx.HTTPError:
            return
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            try:
                v = float(value)
            except ValueError:
                continue
            if name in PEAK_GAUGES:
                self.peaks[name] = max(self.peaks.get(name, 0.0), v * PEAK_GAUGES[name])
            elif name in COUNTERS:
                self.first.setdefault(name, v)
                self.last[name] = v

    def grown(self) -> dict[str, float]:
        return {k.removeprefix("localinfer_"): round(self.last[k] - self.first[k], 3) for k in self.last}

    def __enter__(self):
        self.task = asyncio.ensure_future(self._poll())
        return self

    def __exit__(self, *exc):
        self.task.cancel()


async def closed_loop(client, args, model, texts, concurrency: int) -> dict:
    queue = list(texts)
    results: list[Result] = []
    bar = Progress(len(texts), f"concurrency {concurrency}")

    async def worker():
        while queue:
            results.append(await one(client, args, model, queue.pop(0)))
            bar.tick()

    t0 = time.perf_counter()
    with PeakWatcher(client, args.metrics_url) as peaks:
        await peaks.sample()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await peaks.sample()
    return {"mode": "closed", "concurrency": concurrency, **summarise(results, time.perf_counter() - t0, args),
            "peaks": peaks.peaks, "engine": peaks.grown()}


async def open_loop(client, args, model, texts, rate: float) -> dict:
    rng = random.Random(args.seed)
    bar = Progress(len(texts), f"rate {rate:g}/s")

    async def later(delay, text):
        await asyncio.sleep(delay)
        r = await one(client, args, model, text)
        bar.tick()
        return r

    at, tasks = 0.0, []
    t0 = time.perf_counter()
    with PeakWatcher(client, args.metrics_url) as peaks:
        await peaks.sample()
        for text in texts:
            tasks.append(asyncio.ensure_future(later(at, text)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        await peaks.sample()
    return {"mode": "open", "rate_req_s": rate, **summarise(list(results), time.perf_counter() - t0, args),
            "peaks": peaks.peaks, "engine": peaks.grown()}


async def run_all(args, url: str) -> dict:
    args.metrics_url = re.sub(r"/v1$", "", url) + "/metrics"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model_name or (await client.get("/models")).json()["data"][0]["id"]
        def texts(i: int) -> list[str]:   # fresh prompts per run: a server's cache of the last run must not answer
            return prompts(args.requests, args.prompt_tokens, args.shared_prefix, args.seed + 1000 * i)

        await one(client, args, model, "warm-up: " + " ".join(WORDS[:20]))   # not counted; shares no prefix
        runs = [await closed_loop(client, args, model, texts(i), c) for i, c in enumerate(args.concurrency)]
        runs += [await open_loop(client, args, model, texts(len(runs) + i), r) for i, r in enumerate(args.rate)]
    return {"model": model, "runs": runs}


def start_localinfer(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "localinfer", "serve", *([args.model] if args.model != "default" else []),
           "--port", "0", "--parallel", str(args.parallel), "--ctx", str(args.ctx), "-t", str(args.threads),
           "--max-queue", "1024", *args.serve_arg]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    m = None
    for _ in range(20):                               # the address line, after any notes
        line = p.stderr.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
        if m or not line:
            break
    if not m:
        p.kill()
        sys.exit("localinfer serve did not start: " + p.stderr.read()[-500:])
    url = m.group(1)
    for _ in range(600):
        try:
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    p.kill()
    sys.exit("localinfer serve did not become ready")


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform(),
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}    # other work on the machine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="start `localinfer serve MODEL` ('default': the embedded model)")
    ap.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1")
    ap.add_argument("--label", default=None, help="name of the server in the JSON (default: the URL)")
    ap.add_argument("--model-name", default=None, help="model field to send (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("LOCALINFER_API_KEY"))
    ap.add_argument("--concurrency", default="1,4,8", help="closed-loop levels (comma list; '' for none)")
    ap.add_argument("--rate", default="", help="open-loop Poisson arrival rates in requests/s (comma list)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N", help="words shared by every prompt")
    ap.add_argument("--slo-ttft", type=float, default=10.0, metavar="S")
    ap.add_argument("--slo-e2e", type=float, default=10.0, metavar="S")
    ap.add_argument("--deadline-ms", type=float, default=None,
                    help="send this deadline (localinfer's deadline_ms field and x-localinfer-deadline-ms header)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="with MODEL: serve -t")
    ap.add_argument("--ctx", type=int, default=4096, help="with MODEL: total KV context")
    ap.add_argument("--parallel", type=int, default=8, help="with MODEL: serve --parallel")
    ap.add_argument("--serve-arg", action="append", default=[], help="with MODEL: extra flag for serve")
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    if (args.url is None) == (args.model is None):
        ap.error("give --url URL or MODEL")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rate = [float(r) for r in args.rate.split(",") if r]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # so the server we started is stopped too
    load_before = [round(x, 2) for x in os.getloadavg()]
    proc = None
    url = args.url
    if url is None:
        proc, url = start_localinfer(args)
    try:
        out = asyncio.run(run_all(args, url.rstrip("/")))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    doc = {"server": args.label or url, "machine": dict(machine(), loadavg_before=load_before), "settings": settings,
           **out,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.out + ".tmp", args.out)
    else:
        print(text)
    for r in out["runs"]:
        key = f"c={r['concurrency']}" if r["mode"] == "closed" else f"rate={r['rate_req_s']}"
        print(f"{key:>10}: {r['output_tok_s']:7.2f} tok/s  TTFT p50 {r['ttft_p50_ms']} p95 {r['ttft_p95_ms']} ms  "
              f"ITL p50 {r['itl_p50_ms']} ms  e2e p50 {r['e2e_p50_ms']} ms  goodput {r['goodput_req_s']}/s  "
              f"ok {r['ok']}/{r['requests']}  in llama_decode {r['engine'].get('engine_decode_seconds_total', '-')} s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
