"""Two servers, one client alternating between them block by block: paired ratios that cancel a shared host's drift.

    python benchmarks/serve_paired.py --llama-server PATH|build [--concurrency 1] [--pairs 40] [--out FILE]
    python benchmarks/serve_paired.py --variant-env PYTHONPATH=/path/to/other/tree ...   # localinfer A/B

serve_peers.py measures one server for a whole run (16 requests, half a minute and more at one client), then the
other; on this shared VM a slow minute moves one run's ratio by 5-15%, more than the effect a change to the serving
layer has.  Here both servers run at once and the load alternates between them in short blocks: a block is
``--block`` requests (default: one at one client, two per client otherwise) sent as a closed loop at
``--concurrency``; each pair of blocks gets the same fresh prompts (each server sees each prompt once, so no
prefix cache answers), and the order within a pair alternates (AB, BA, ...) so neither server always goes first.
A block of the measured shape goes to each server first, uncounted, and each block starts after a 0.3 s pause.
Each pair gives ratios of localinfer's figures over the peer's (tok/s over the block; tok/s while every client has
a request in, from the first wave's end to the last request's send: ``steady_tok_s``, for blocks of at least three
times the concurrency; the median of its requests' decode rates from first to last text chunk; TTFT p50; ITL p50;
the p50 of each reply's last gap (to its last text chunk: what a server does as a reply ends shows there); e2e
p50); each block's ``finish_s`` (its requests' ends, seconds from its start) is kept, and ``--rescore OUT.json``
recomputes a written run's steady figure from them.  The summary is their median, their
geometric mean with a bootstrap 95% interval (seeded by ``--seed``), and how many pairs localinfer won.  A pair in
which any request failed is left out of the ratios and counted.  Nothing polls /metrics (serve_load.py polls five
times a second).  With an even ``--pairs`` each server goes first equally often.

The peer is llama-server (``--llama-server``: same flags as serve_peers.py's) or, with ``--variant-env`` /
``--variant-arg``, a second localinfer server (serve_peers.py's ``localinfer-b``): the ratio is the default's
over the variant's.  The load is loadgen's: streaming /v1/completions, ``--prompt-tokens`` of seeded common
words, ``--output-tokens`` with EOS ignored, greedy.  Writes OUT.json (every block's figures, the commands, the
machine, the load average beside each pair) and OUT.txt (the summary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import serve_peers as SP                                           # noqa: E402

from localinfer.loadgen import load as L                          # noqa: E402
from localinfer.model.sources import resolve_model               # noqa: E402
from localinfer.util.stats import percentile, ratio_interval      # noqa: E402

SETTLE_S = 0.3       # a pause before each block: the last block's server finishes its own after-work first
KEYS = ("tok_s", "steady_tok_s", "decode_tok_s", "ttft_p50_ms", "itl_p50_ms", "last_gap_p50_ms", "e2e_p50_ms")
HIGHER_IS_BETTER = {"tok_s", "steady_tok_s", "decode_tok_s"}
# serving switches a run records (never the whole environment: LOCALINFER_API_KEY is a secret)
RECORDED_ENV = ("LOCALINFER_PREFILL_ASIDE", "LOCALINFER_STEADY_STEP", "LOCALINFER_EVENT_LOOP")


def steady_rate(finishes: list[tuple[float, int]], concurrency: int) -> float | None:
    """Output tokens a second while every client has a request in: from the ``concurrency``-th finish (the first
    wave's end) to the one at which the block's last request is sent (the ``concurrency + 1``-th from last), the
    tokens of the requests that finished after the first and up to the second, over that span (None when the
    block has fewer than 3 x ``concurrency`` requests).  A block's whole rate (``tok_s``) also counts its start,
    when the first prompts run, and its drain, when fewer than ``concurrency`` requests are left and each step
    carries fewer rows: a schedule that staggers its requests drains over several requests' lengths, one that runs
    them in waves ends a wave at once.  For a schedule in waves the span is whole waves."""
    ends = sorted(finishes)
    if len(ends) < 3 * concurrency:
        return None
    a, b = concurrency - 1, len(ends) - concurrency - 1
    first, last = ends[a][0], ends[b][0]
    tokens = sum(n for _, n in ends[a + 1:b + 1])
    return tokens / (last - first) if last > first else None


def block_figures(results: list[L.Result], makespan: float, finishes: list[float] | None = None,
                  concurrency: int = 1) -> dict:
    """One block's figures; ``decode_tok_s``: the median over its requests of (tokens - 1) / the time from their
    first text chunk to their last (not to the stream's end: what a server does after its last token differs);
    ``steady_tok_s``: :func:`steady_rate` over ``finishes`` (each request's end, seconds from the block's start,
    in ``results``' order)."""
    ok = [r for r in results if r.ok]
    ends = [(t, r.output_tokens) for t, r in zip(finishes or [], results)]
    decode = [(r.output_tokens - 1) / sum(r.gaps_s) for r in ok if sum(r.gaps_s) > 0 and r.output_tokens > 1]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"requests": len(results), "ok": len(ok), "makespan_s": makespan,
            "tok_s": sum(r.output_tokens for r in ok) / max(makespan, 1e-9),
            "steady_tok_s": steady_rate(ends, concurrency) if len(ok) == len(results) else None,
            "finish_s": [round(t, 4) for t, _ in sorted(ends)],
            "decode_tok_s": statistics.median(decode) if decode else None,
            "ttft_p50_ms": ms(percentile([r.ttft_s for r in ok], 0.5)),
            "itl_p50_ms": ms(percentile([g for r in ok for g in r.gaps_s], 0.5)),
            "last_gap_p50_ms": ms(percentile([r.gaps_s[-1] for r in ok if r.gaps_s], 0.5)),
            "e2e_p50_ms": ms(percentile([r.e2e_s for r in ok], 0.5)),
            "errors": sorted({f"{r.status} {r.error}" for r in results if not r.ok})[:3]}


async def run_block(client, config: L.LoadConfig, model: str, texts: list[str], concurrency: int) -> dict:
    queue = list(texts)
    results: list[L.Result] = []
    finishes: list[float] = []

    async def worker():
        while queue:
            results.append(await L.one(client, config, model, queue.pop(0)))
            finishes.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return block_figures(results, time.perf_counter() - t0, finishes, concurrency)


def summary(pairs: list[dict], peer: str, seed: int) -> dict:
    """The ratios' median, geometric mean and bootstrap interval per figure, over the pairs in which every request
    of both blocks succeeded (the others are counted in ``pairs_left_out``)."""
    whole = [p for p in pairs if not p["failed"]]
    out = {"pairs_left_out": len(pairs) - len(whole)}
    for key in KEYS:
        xs = [p["ratio"][key] for p in whole if p["ratio"].get(key)]
        if not xs:
            continue
        geo, lo, hi = ratio_interval(xs, seed=seed)
        better = (lambda x: x > 1.0) if key in HIGHER_IS_BETTER else (lambda x: x < 1.0)
        out[key] = {"median": statistics.median(xs), "geomean": geo, "ci95": [lo, hi],
                    "localinfer_better": sum(map(better, xs)), "pairs": len(xs)}
    return {"peer": peer, **out}


def render(doc: dict) -> str:
    s = doc["summary"]
    lines = [f"localinfer over {s['peer']}: {doc['pairs_run']} pairs of {doc['block']} request(s) at concurrency "
             f"{doc['concurrency']}, {doc['prompt_tokens']} prompt + {doc['output_tokens']} output tokens "
             f"({doc['when']}, load average {doc['loadavg_before'][0]:.2f} before, "
             f"{doc['loadavg_after'][0]:.2f} after)"
             + "".join(f"; {k}={v}" for k, v in doc.get("environment", {}).items()),
             f"{'figure':<14}{'median':>8}{'geomean':>9}{'95% interval':>16}{'localinfer better':>19}"]
    for key in KEYS:
        if key in s:
            f = s[key]
            lines.append(f"{key:<14}{f['median']:>7.3f}x{f['geomean']:>8.3f}x   [{f['ci95'][0]:.3f}, "
                         f"{f['ci95'][1]:.3f}]{f['localinfer_better']:>10} of {f['pairs']}")
    means = {n: statistics.fmean(b[n]["tok_s"] for b in doc["blocks"]) for n in doc["servers"]}
    failed = {n: sum(b[n]["requests"] - b[n]["ok"] for b in doc["blocks"]) for n in doc["servers"]}
    lines.append("mean tok/s a block: " + ", ".join(f"{n} {v:.1f}" for n, v in means.items())
                 + "; requests failed: " + ", ".join(f"{n} {v}" for n, v in failed.items())
                 + f"; pairs left out (a request failed): {s['pairs_left_out']}")
    return "\n".join(lines)


async def measure(args, urls: dict[str, str], config: L.LoadConfig) -> tuple[list[dict], list[dict]]:
    names = list(urls)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=L.KEEPALIVE_S)
    clients = {n: httpx.AsyncClient(base_url=u, timeout=config.timeout, limits=limits) for n, u in urls.items()}
    try:
        models = {n: await L._model(clients[n], urls[n], config) for n in names}
        warm = ["warm-up: " + t for t in L.prompts(args.block, config.prompt_tokens, 0, args.seed - 1)]
        for n in names:                    # uncounted, the measured shape: first graphs, batch sizes, connections
            got = await run_block(clients[n], config, models[n], warm, args.concurrency)
            if got["ok"] < got["requests"]:
                sys.exit(f"serve_paired: {n}'s warm-up failed: {got['errors']}")
        blocks, pairs = [], []
        for i in range(args.pairs):
            texts = L.prompts(args.block, config.prompt_tokens, 0, args.seed + 1000 * i)
            order = names if i % 2 == 0 else names[::-1]
            got = {}
            load = os.getloadavg()[0]
            for n in order:
                await asyncio.sleep(SETTLE_S)
                got[n] = await run_block(clients[n], config, models[n], texts, args.concurrency)
            a, b = got[names[0]], got[names[1]]
            failed = any(x["ok"] < x["requests"] for x in (a, b))
            ratio = {} if failed else {k: a[k] / b[k] for k in KEYS if a.get(k) and b.get(k)}
            pairs.append({"pair": i, "order": order, "loadavg": load, "failed": failed, "ratio": ratio})
            blocks.append(got)
            print(f"pair {i + 1}/{args.pairs} ({'/'.join(order)}): tok/s {a['tok_s']:.1f} vs {b['tok_s']:.1f}"
                  + (f" (left out: failed {a['errors'] + b['errors']})" if failed else
                     f" = {ratio.get('tok_s', 0):.3f}x") + (f" (steady {ratio['steady_tok_s']:.3f}x)"
                                                             if "steady_tok_s" in ratio else "")
                  + f", load {load:.2f}", file=sys.stderr, flush=True)
        return blocks, pairs
    finally:
        for c in clients.values():
            await c.aclose()


def rescore(path: str, seed: int | None = None) -> dict:
    """A written run's ``steady_tok_s`` again from its blocks' ``finish_s`` (as :func:`steady_rate` now reads
    them), with the pairs' ratios and the summary (its interval drawn with the run's seed, or ``seed`` for a run
    that did not record one); every other figure as recorded."""
    doc = json.loads(Path(path).read_text())
    if not any("finish_s" in fig for block in doc["blocks"] for fig in block.values()):
        raise ValueError(f"{path}: no block records finish_s (a run before serve_paired kept them)")
    if doc.get("seed", seed) is None:
        raise ValueError(f"{path} records no seed: give the run's --seed")
    doc["seed"] = doc.get("seed", seed)
    c, out = doc["concurrency"], doc["output_tokens"]
    for block, pair in zip(doc["blocks"], doc["pairs"]):
        for fig in block.values():
            whole = fig["ok"] == fig["requests"] and "finish_s" in fig
            fig["steady_tok_s"] = steady_rate([(t, out) for t in fig["finish_s"]], c) if whole else None
        a, b = (block[n]["steady_tok_s"] for n in doc["servers"])
        pair["ratio"].pop("steady_tok_s", None)
        if not pair["failed"] and a and b:
            pair["ratio"]["steady_tok_s"] = a / b
    fresh = summary(doc["pairs"], doc["summary"]["peer"], doc["seed"]).get("steady_tok_s")
    doc["summary"].pop("steady_tok_s", None)
    if fresh:                   # the other figures' summaries (and their bootstrap draws) stay as recorded
        doc["summary"]["steady_tok_s"] = fresh
    doc["rescored"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--llama-server", default=None, metavar="PATH|build", help="the peer: a llama-server binary")
    SP.add_localinfer_arguments(ap)         # the peer may be a second localinfer: --variant-arg / --variant-env
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--block", type=int, default=None, help="requests a block (default: 1 at concurrency 1, "
                                                            "else twice the concurrency)")
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=None, help="the bootstrap's and prompts' seed (default 1)")
    ap.add_argument("--out", default="benchmarks/results/serve_paired_cpu")
    ap.add_argument("--rescore", metavar="OUT.json", help="recompute a written run's steady_tok_s and write it back")
    args = ap.parse_args(argv)
    if args.rescore:
        try:
            doc = rescore(args.rescore, args.seed)
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--rescore: {exc}")
        text = render(doc)
        SP.write_results(str(Path(args.rescore).with_suffix("")), doc, text)
        print(text)
        return 0
    variant = bool(args.variant_arg or args.variant_env)
    if variant == bool(args.llama_server):
        ap.error("name one peer: --llama-server, or --variant-env / --variant-arg for a second localinfer")
    if args.concurrency < 1 or args.pairs < 1 or (args.block is not None and args.block < 1):
        ap.error("--concurrency, --pairs and --block must be at least 1")
    SP.check_variant_env(ap, args)
    args.seed = 1 if args.seed is None else args.seed
    args.block = args.block or (1 if args.concurrency == 1 else 2 * args.concurrency)
    args.llama_cpp_python = None
    model = str(resolve_model(args.model).resolve())
    SP.peers(args)
    if args.llama_server and os.sep in args.llama_server:
        args.llama_server = os.path.abspath(args.llama_server)
    peer = "localinfer-b" if variant else "llama-server"
    ports = {name: SP.free_port() for name in SP.SERVERS}
    cmds = SP.commands(args, model, args.ctx, ports)
    cmds = {n: cmds[n] for n in ("localinfer", peer)}
    urls = {n: f"http://127.0.0.1:{ports[n]}/v1" for n in cmds}
    config = L.LoadConfig(concurrency=(args.concurrency,), requests=args.block, prompt_tokens=args.prompt_tokens,
                          output_tokens=args.output_tokens, seed=args.seed)
    before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, SP.running(cmds, urls, Path(tmp)):
        blocks, pairs = asyncio.run(measure(args, urls, config))
    doc = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": SP.machine(), "model": model,
           "servers": list(cmds), "commands": cmds,
           "environment": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
           "concurrency": args.concurrency, "block": args.block,
           "pairs_run": len(pairs), "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
           "threads": args.threads, "seed": args.seed, "loadavg_before": list(before),
           "loadavg_after": list(os.getloadavg()),
           "summary": summary(pairs, peer, args.seed), "pairs": pairs, "blocks": blocks}
    text = render(doc)
    SP.write_results(args.out, doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
