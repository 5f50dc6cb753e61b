"""Request by request, the shared-prefix scenario of serve_peers.py: when each was sent, its TTFT, and how much of
its prompt the server took from its cache.

    python benchmarks/serve_prefix_trace.py [--llama-server PATH] [--concurrency 4,8] [--out FILE]

Closed loop, 16 prompts of 1,300 words whose first 1,000 are the same (the load of serve_load.py's
``--shared-prefix 1000``), 128 tokens out with EOS ignored, total context 8192 over 8 slots for both servers.
Cached tokens are ``usage.prompt_tokens_details.cached_tokens``, and llama-server's own ``timings.cache_n``
where it sends them.  A request whose stream carried an error event is marked ``error`` with the message.
The servers run one after the other, each started fresh per concurrency level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_peers import SCENARIOS, commands, free_port, machine, stop, wait_ready   # noqa: E402
from localinfer.model.sources import resolve_model                                            # noqa: E402
from localinfer.loadgen.load import KEEPALIVE_S, prompts                                     # noqa: E402
from localinfer.util.stats import percentile                                                  # noqa: E402

SCENARIO = SCENARIOS["prefix"]


async def one(client, model: str, prompt: str, output_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, timings, error = None, {}, {}, None
    async with client.stream("POST", "/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                error = str(ev["error"].get("message", ev["error"]))[:120]
            usage, timings = ev.get("usage") or usage, ev.get("timings") or timings
            if ttft is None and any(c.get("text") for c in ev.get("choices") or []):
                ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "status": r.status_code, "error": error,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "cache_n": timings.get("cache_n")}


async def trace(url: str, texts: list[str], concurrency: int, output_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        queue, rows, t0 = list(enumerate(texts)), [], time.perf_counter()

        async def worker():
            while queue:
                i, text = queue.pop(0)
                sent = time.perf_counter() - t0
                rows.append({"request": i, "sent_s": round(sent, 2), **await one(client, model, text, output_tokens)})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(rows, key=lambda r: (r["sent_s"], r["request"]))


def render(name: str, concurrency: int, rows: list[dict]) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)
    out = [f"{name}, concurrency {concurrency}",
           f"{'req':>4}{'sent':>8}{'TTFT':>8}{'e2e':>8}{'prompt':>8}{'cached':>8}{'cache_n':>8}  error"]
    for r in rows:
        out.append(f"{r['request']:>4}{r['sent_s']:>7.2f}s{f(r['ttft_s'], '.2f'):>7}s{r['e2e_s']:>7.2f}s"
                   f"{f(r['prompt_tokens'], 'd'):>8}{f(r['cached_tokens'], 'd'):>8}{f(r['cache_n'], 'd'):>8}"
                   f"  {r['error'] or ''}")
    ok = [r["ttft_s"] for r in rows if r["ttft_s"] is not None and not r["error"]]
    p50 = percentile(ok, 0.5)
    out.append(f"  {len(ok)}/{len(rows)} whole; TTFT p50 over those {'-' if p50 is None else f'{p50:.2f} s'}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    ap.add_argument("--concurrency", default="4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--out", default=None, help="write FILE.json and FILE.txt (default: print)")
    args = ap.parse_args(argv)
    args.llama_cpp_python = None
    model = str(resolve_model(args.model))
    load = SCENARIO["load"]
    n, words, shared, out_tokens = (int(load[load.index(k) + 1]) for k in
                                    ("--requests", "--prompt-tokens", "--shared-prefix", "--output-tokens"))
    before, runs, texts = machine(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        for level in [int(c) for c in args.concurrency.split(",")]:
            texts = prompts(n, words, shared, args.seed + level)
            ports = {name: free_port() for name in ("localinfer", "llama-server", "llama-cpp-python")}
            for name, cmd in commands(args, model, SCENARIO["ctx"], ports).items():
                print(f"concurrency {level}: {name}", file=sys.stderr, flush=True)
                log = Path(tmp) / f"{name}-{level}.log"
                proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
                url = f"http://127.0.0.1:{ports[name]}/v1"
                try:
                    wait_ready(url, proc, log)
                    rows = asyncio.run(trace(url, texts, level, out_tokens))
                finally:
                    stop(proc)
                errors = [ln for ln in log.read_text(errors="replace").splitlines() if " E " in ln][:3]
                runs.append({"server": name, "concurrency": level, "rows": rows, "command": cmd,
                             "log_errors": errors})
    text = "\n\n".join(render(r["server"], r["concurrency"], r["rows"])
                       + "".join(f"\n  log: {e[:150]}" for e in r["log_errors"]) for r in runs)
    print(text)
    if args.out:
        doc = {"machine": dict(machine(), loadavg_before=before["loadavg_1_5_15"]), "model": model,
               "ctx": SCENARIO["ctx"], "load": load, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "runs": runs}
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
        Path(args.out + ".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
