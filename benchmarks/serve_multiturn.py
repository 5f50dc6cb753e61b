"""Multi-turn chats from several users at once: how much of each turn's history a server keeps.

    python benchmarks/serve_multiturn.py [--llama-server PATH] [--parked 1,16] [--rounds 2] [--out FILE]

A chat front end sends a conversation's whole history with every turn.  ``--users`` conversations of
``--turns`` turns each share one system prompt; ``--concurrency`` clients take the next turn whose
conversation is not waiting for its previous reply (so between two turns of one user, the others' turns
run), stream it (``/v1/chat/completions``, greedy, ``--output-tokens`` tokens with EOS ignored) and put the
reply into that conversation's history.  For turns after the first it reports TTFT p50/p95 and the share
of prompt tokens the server said came from its cache (``usage.prompt_tokens_details.cached_tokens``).

``--hybrid ARCH`` runs it on a hybrid model (a recurrent state beside attention: qwen35, granitehybrid, lfm2)
written here with random weights at about SmolLM2-135M's size (``HYBRID_SIZES``), so that a turn's prompt costs
what such a model's prefill costs: a prefix hit then restores a recurrent-state snapshot (localinfer) or a
context checkpoint (llama-server, on by default), and the table adds the prompt tokens each server recomputed
per turn.

Servers: ``localinfer serve --parked N`` for each N of ``--parked`` (finished requests whose KV stays in
host memory for later prefix hits), and llama-server (``-np 8 --kv-unified``: its slots keep their last
prompt, and ``--cache-ram``, 8 GiB by default, keeps older prompts' states in host memory).  They take
turns, ``--rounds`` times, so a shared machine's drift falls on all of them; each is started fresh per
round.  Same model, threads, total context and flash attention for all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_peers import free_port, machine, stop, wait_ready   # noqa: E402
from localinfer.model.sources import resolve_model                 # noqa: E402
from localinfer.loadgen.load import KEEPALIVE_S, RESEND_WITHIN_S, WORDS   # noqa: E402
from localinfer.util.stats import percentile                        # noqa: E402


# A hybrid of about 110M parameters (Q8_0), the shape of its architecture's tiny test file scaled up: prompts cost
# prefill time on a CPU (a tiny file's would not), as on SmolLM2-135M.
HYBRID_SIZES = {
    "qwen35": {"arch": "qwen35", "n_layers": 12, "n_embd": 768, "n_head": 12, "n_head_kv": 4, "head_dim": 64,
               "n_ff": 2048, "ssm_state": 64, "ssm_groups": 4, "ssm_dt_rank": 16, "rope_sections": [16, 8, 8, 0]},
    "granitehybrid": {"arch": "granitehybrid", "n_layers": 12, "n_embd": 768, "n_head": 12, "n_head_kv": 4,
                      "n_ff": 2048, "ssm_inner": 1536, "ssm_state": 64, "ssm_dt_rank": 24, "layer_pattern": "MMM*"},
    "lfm2": {"arch": "lfm2", "n_layers": 12, "n_embd": 768, "n_head": 12, "n_head_kv": 4, "n_ff": 2048},
}


def write_hybrid(arch: str, folder: Path) -> str:
    """A random-weight ``arch`` hybrid of ``HYBRID_SIZES`` (the tests' writer: what llama.cpp's converter writes)."""
    from gguf import GGMLQuantizationType

    from tests.support.ggufgen import write_tiny_arch
    from tests.support.tiny_archs import TINY

    spec = {**TINY[arch], **HYBRID_SIZES[arch], "context_length": 32768}
    return str(write_tiny_arch(folder / f"{arch}-hybrid.gguf", spec, qtype=GGMLQuantizationType.Q8_0, seed=1))


def conversations(users: int, turns: int, system_words: int, user_words: int, seed: int):
    """(system prompt, [[user message per turn] per user]): seeded words, every message different."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    system = "You are a helpful assistant. " + words(system_words)
    return system, [[f"User {u}, turn {t}: {words(user_words)}" for t in range(turns)] for u in range(users)]


async def chat_turn(client, model: str, messages: list[dict], output_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    for attempt in range(2):
        try:
            async with client.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return {"ok": False, "status": r.status_code,
                            "error": (await r.aread()).decode(errors="replace")[:200]}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:         # an error event inside the 200 stream: not a reply
                        return {"ok": False, "status": 200, "error": str(ev["error"])[:200]}
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for c in ev.get("choices") or []:
                        text = (c.get("delta") or {}).get("content")
                        if text:
                            ttft = ttft if ttft is not None else time.perf_counter() - t0
                            parts.append(text)
            break
        except httpx.RemoteProtocolError:   # a kept-alive connection the server closed as this went out
            if attempt or ttft is not None or time.perf_counter() - t0 > RESEND_WITHIN_S:
                raise
    details = usage.get("prompt_tokens_details") or {}
    return {"ok": ttft is not None, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "text": "".join(parts),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0) or usage.get("cached_tokens", 0) or 0,
            "completion_tokens": usage.get("completion_tokens", 0)}


async def run_chats(url: str, system: str, users: list[list[str]], concurrency: int, output_tokens: int) -> dict:
    limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)     # as serve_load: under the servers' keep-alive
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        await chat_turn(client, model, [{"role": "user", "content": "warm up"}], 4)
        history = [[{"role": "system", "content": system}] for _ in users]
        next_turn = [0] * len(users)
        busy = [False] * len(users)
        results: list[dict] = []
        wake = asyncio.Condition()
        t0 = time.perf_counter()

        def pick():
            ready = [u for u in range(len(users)) if not busy[u] and next_turn[u] < len(users[u])]
            return min(ready, key=lambda u: (next_turn[u], u)) if ready else None   # the longest-waiting user

        async def worker():
            while True:
                async with wake:
                    while (u := pick()) is None:
                        if all(next_turn[v] == len(users[v]) for v in range(len(users))):
                            return
                        await wake.wait()
                    busy[u], turn = True, next_turn[u]
                msgs = history[u] + [{"role": "user", "content": users[u][turn]}]
                got = await chat_turn(client, model, msgs, output_tokens)
                got.update(user=u, turn=turn)
                results.append(got)
                async with wake:
                    history[u] = msgs + [{"role": "assistant", "content": got.get("text", "")}]
                    busy[u], next_turn[u] = False, turn + 1
                    wake.notify_all()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        makespan = time.perf_counter() - t0
    return summarise(results, makespan)


def summarise(results: list[dict], makespan: float) -> dict:
    later = [r for r in results if r["ok"] and r["turn"] > 0]
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 1) if xs else None
    ttft = [r["ttft_s"] for r in later]
    prompt = sum(r["prompt_tokens"] for r in later)
    return {"requests": len(results), "ok": sum(r["ok"] for r in results), "makespan_s": round(makespan, 2),
            "output_tok_s": round(sum(r.get("completion_tokens", 0) for r in results) / makespan, 2),
            "later_ttft_p50_ms": ms(ttft, 0.5), "later_ttft_p95_ms": ms(ttft, 0.95),
            "later_prompt_tokens": prompt, "later_cached_tokens": sum(r["cached_tokens"] for r in later),
            "later_cached_share": round(sum(r["cached_tokens"] for r in later) / prompt, 3) if prompt else None,
            "recomputed_per_turn": _per_turn(later),
            "turns": [{k: r.get(k) for k in ("user", "turn", "ttft_s", "prompt_tokens", "cached_tokens", "ok")}
                      for r in sorted(results, key=lambda r: (r["turn"], r["user"]))]}


def _per_turn(later: list[dict]) -> dict:
    """Turn -> (median TTFT ms, mean prompt tokens the server computed again: prompt − cached)."""
    out = {}
    for turn in sorted({r["turn"] for r in later}):
        rows = [r for r in later if r["turn"] == turn]
        out[turn] = {"ttft_p50_ms": round(statistics.median(r["ttft_s"] for r in rows) * 1e3, 1),
                     "recomputed": round(statistics.mean(r["prompt_tokens"] - r["cached_tokens"] for r in rows), 1),
                     "prompt": round(statistics.mean(r["prompt_tokens"] for r in rows), 1)}
    return out


def servers(args, model: str) -> dict[str, callable]:
    """name -> (port -> command)."""
    t, ctx = str(args.threads), str(args.ctx)
    out = {}
    for p in args.parked:
        out[f"localinfer --parked {p}"] = lambda port, p=p: [
            sys.executable, "-m", "localinfer", "serve", model, "--port", str(port), "--parallel", "8", "--ctx", ctx,
            "-t", t, "-fa", "on", "--max-queue", "1024", "--parked", str(p)]
    if args.llama_server:
        out["llama-server"] = lambda port: [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                                            "-c", ctx, "-np", "8", "--kv-unified", "--no-webui", "-t", t, "-tb", t,
                                            "-fa", "on"]
    return out


def measure(name: str, command, args, convo, tmp: Path) -> dict:
    port = free_port()
    log = tmp / f"{name.replace(' ', '_')}.log"
    proc = subprocess.Popen(command(port), stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready(url, proc, log)
        return asyncio.run(run_chats(url, *convo, args.concurrency, args.output_tokens))
    finally:
        stop(proc)


def table(doc: dict) -> str:
    lines = [f"{'server':<24}{'round':>6}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p95':>10}{'cached':>8}{'ok':>8}"]
    for row in doc["rows"]:
        r = row["run"]
        lines.append(f"{row['server']:<24}{row['round']:>6}{r['output_tok_s']:>8.1f}"
                     f"{(r['later_ttft_p50_ms'] or 0) / 1e3:>9.2f}s{(r['later_ttft_p95_ms'] or 0) / 1e3:>9.2f}s"
                     f"{(r['later_cached_share'] or 0) * 100:>7.0f}%{r['ok']:>4}/{r['requests']:<3}")
    lines.append("medians over rounds (turns after the first):")
    for name in dict.fromkeys(row["server"] for row in doc["rows"]):
        runs = [row["run"] for row in doc["rows"] if row["server"] == name]
        med = lambda k: statistics.median(r[k] or 0 for r in runs)
        lines.append(f"  {name:<24} TTFT p50 {med('later_ttft_p50_ms') / 1e3:.2f}s  p95 "
                     f"{med('later_ttft_p95_ms') / 1e3:.2f}s  cached {med('later_cached_share') * 100:.0f}%  "
                     f"tok/s {med('output_tok_s'):.1f}")
    lines.append("per turn (medians over rounds): TTFT p50 / prompt tokens recomputed of the prompt")
    names = list(dict.fromkeys(row["server"] for row in doc["rows"]))
    turns = sorted({t for row in doc["rows"] for t in row["run"].get("recomputed_per_turn", {})}, key=int)
    for t in turns:
        cells = []
        for name in names:
            got = [row["run"]["recomputed_per_turn"][t] for row in doc["rows"]
                   if row["server"] == name and t in row["run"].get("recomputed_per_turn", {})]
            if got:
                cells.append(f"{name}: {statistics.median(g['ttft_p50_ms'] for g in got) / 1e3:.2f}s / "
                             f"{statistics.median(g['recomputed'] for g in got):.0f} of "
                             f"{statistics.median(g['prompt'] for g in got):.0f}")
        lines.append(f"  turn {t}: " + "; ".join(cells))
    return "\n".join(lines)


def header(doc: dict) -> str:
    """The result file's first lines: what ran, on which machine, when."""
    m, st = doc["machine"], doc["settings"]
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in st.items() if v not in (None, False) and k != "parked")
    return (f"# benchmarks/serve_multiturn.py {args} --parked {','.join(map(str, st['parked']))}\n"
            f"# {doc['when']}, {m.get('cores')}-core {m.get('cpu')} VM, no GPU; load average before "
            f"{m.get('loadavg_before')}, after {m.get('loadavg_1_5_15')}; model: {doc['model']}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    ap.add_argument("--hybrid", default=None, choices=sorted(HYBRID_SIZES),
                    help="run on a random-weight hybrid model of this architecture written here (not --model)")
    ap.add_argument("--parked", default="1,16", help="localinfer --parked values to run (comma list)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--user-words", type=int, default=60)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write FILE.json and FILE.txt (default: print the table)")
    args = ap.parse_args(argv)
    args.parked = [int(p) for p in args.parked.split(",") if p != ""]
    before = machine()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_hybrid(args.hybrid, Path(tmp)) if args.hybrid else str(resolve_model(args.model))
        for rnd in range(args.rounds):
            convo = conversations(args.users, args.turns, args.system_words, args.user_words, args.seed + rnd)
            for name, command in servers(args, model).items():
                print(f"round {rnd}: {name}", file=sys.stderr, flush=True)
                rows.append({"server": name, "round": rnd, "run": measure(name, command, args, convo, Path(tmp))})
    shown = f"{args.hybrid} hybrid, random weights {HYBRID_SIZES[args.hybrid]}" if args.hybrid else model
    doc = {"machine": dict(machine(), loadavg_before=before["loadavg_1_5_15"]), "model": shown,
           "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    text = table(doc)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
        Path(args.out + ".txt").write_text(header(doc) + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
