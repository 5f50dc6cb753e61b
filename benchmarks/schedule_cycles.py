"""What one closed-loop cycle costs in llama.cpp under each server's schedule, in process (issue 45).

    python benchmarks/schedule_cycles.py [MODEL] [--concurrency 4] [--rounds 3] [--cycles 2]
        [--via raw|raw-aside|executor|executor-aside] [--json OUT]

A cycle is ``--concurrency`` requests of ``--prompt-tokens`` prompt tokens and ``--output-tokens`` tokens out, at
the closed loop's steady state.  Two schedules over one llama.cpp context set up as ``serve_peers.py`` runs both
servers (batch_costs.py's: 4096 cells in one unified pool, 8 sequences, flash attention on, ``n_ubatch`` 512):

- **waves** (llama-server at four and eight clients: its requests end in the same step, the clients' next ones
  arrive together, and their prompts go in one batch): the cache cleared, the c prompts in one call (llama.cpp
  cuts it into ubatches), then one decode step of c rows per output token after the first;
- **staggered** (localinfer's: a request's prompt starts as soon as it arrives): the c sequences ``--output-tokens
  / c`` tokens apart; whenever one ends it is removed and the next prompt goes in a call of its own, the other
  sequences' decode rows in a second call (the executor's ``split_short``), then the decode steps of c rows go on.

``--via raw`` makes the calls on a bare context (``batch_costs.Context``): each cycle's llama_decode seconds split
into prompt calls, the staggered schedule's short calls (the decode rows beside a prompt) and decode steps;
``raw-aside`` computes each lone prompt in a second context's empty cache and copies its sequence state in (what
the running sequences' cells in a prompt's view cost it, against that copy).
``--via executor`` makes the same steps through ``LlamaCppExecutor`` with ``serve``'s cache settings (a prompt and
the rows beside it in one step, which the executor runs short rows first in a call of their own; the unified cache
compacted when its policy says so), each step's wall time counted, a prompt step's whole under prompts;
``executor-aside`` with its second context for lone prompts (backends/llamacpp/aside.py, serve's default). The
staggered schedule's first cycle brings it to its steady state and is not counted. No HTTP, sampling or scheduler:
what the two arrangements cost llama.cpp alone, to set beside the servers' cycles (``serve_paired.py``'s
``finish_s``). The schedules alternate within each round, so drift on a shared host meets both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_costs import Context                         # noqa: E402

from localinfer.backends.llamacpp import seq_state       # noqa: E402
from localinfer.loadgen.load import machine             # noqa: E402
from localinfer.model.sources import resolve_model      # noqa: E402
from localinfer.util.atomic import atomic_write          # noqa: E402


class Raw:
    """llama_decode calls as a server's batch makes them (batch_costs.Context).  With ``aside`` (a second context
    of the same model), a lone prompt beside running sequences is computed there, in an empty cache, and its
    sequence state copied into the main context (``llama_state_seq_get_data`` / ``set_data``): the prompt's
    attention then spans its own cells only, at the cost of the copy (counted with the prompt)."""

    def __init__(self, c: Context, aside: Context | None = None):
        self.c, self.aside = c, aside
        self.copied = 0       # prompts computed aside and copied in

    def clear(self) -> None:
        self.c.L.llama_memory_clear(self.c.mem, True)

    def drop(self, s: int) -> None:
        self.c.L.llama_memory_seq_rm(self.c.mem, s, -1, -1)

    def step(self, prompts: dict[int, list[int]], rows: dict[int, tuple[int, int]]) -> tuple[float, float]:
        """``prompts`` (sequence -> tokens from position 0) in one call, then ``rows`` (sequence -> (token,
        position)) in a call of their own; (prompt seconds, rows seconds)."""
        if self.aside is not None and len(prompts) == 1 and rows:
            pre = self._aside(*next(iter(prompts.items())))
        else:
            pre = self.c.decode([(t, i, s, i == len(ts) - 1) for s, ts in prompts.items()
                                 for i, t in enumerate(ts)]) if prompts else 0.0
        dec = self.c.decode([(t, pos, s, True) for s, (t, pos) in rows.items()]) if rows else 0.0
        return pre, dec


    def _aside(self, seq: int, tokens: list[int]) -> float:
        a, L = self.aside, self.c.L
        t0 = time.perf_counter()
        L.llama_memory_clear(a.mem, True)
        a.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        blob = seq_state.read_cells(a.ctx, 0)
        if blob is None or not seq_state.write_cells(self.c.ctx, seq, blob):
            raise RuntimeError("a sequence state did not copy")
        self.copied += 1
        return time.perf_counter() - t0


class Executor:
    """localinfer's own: ``LlamaCppExecutor`` with ``serve``'s cache settings (short chunks in a call of their
    own, the unified cache compacted when its policy says so; no parked ids, rows copied rather than lent); a
    step's seconds are its wall time, and a prompt step (its rows' call included) counts whole under prompts."""

    def __init__(self, model: str, threads: int, aside: bool = False):
        from localinfer.backends.llamacpp.executor import LlamaCppExecutor
        self.x = LlamaCppExecutor.open(model, n_slots=8, n_ctx=4096, threads=threads, flash_attn=True,
                                       prefill_aside=aside)

    def clear(self) -> None:
        for s in range(self.x.n_slots):
            self.x.drop(s)

    def drop(self, s: int) -> None:
        self.x.drop(s)

    def step(self, prompts: dict[int, list[int]], rows: dict[int, tuple[int, int]]) -> tuple[float, float]:
        from localinfer.backends.executor import Chunk
        chunks = [Chunk(s, tuple(ts), 0, logits=True) for s, ts in prompts.items()]
        chunks += [Chunk(s, (t,), pos, logits=True) for s, (t, pos) in rows.items()]
        t0 = time.perf_counter()
        self.x.step(chunks)
        dt = time.perf_counter() - t0
        return (dt, 0.0) if prompts else (0.0, dt)


class Cycles:
    """The two schedules over one backend; ``tok()`` a random token (the text does not change a step's cost)."""

    def __init__(self, ops, k: int, prompt: int, out: int, seed: int = 0):
        self.ops, self.k, self.prompt, self.out = ops, k, prompt, out
        rng = random.Random(seed)
        self.tok = lambda: rng.randrange(100, 40000)      # noqa: E731

    def _step(self, length: dict[int, int], new: list[int], seqs: list[int]) -> tuple[float, float]:
        got = self.ops.step({s: [self.tok() for _ in range(self.prompt)] for s in new},
                            {s: (self.tok(), length[s]) for s in seqs})
        for s in seqs:
            length[s] += 1
        for s in new:
            length[s] = self.prompt
        return got

    def waves(self, cycles: int) -> list[dict]:
        got = []
        for _ in range(cycles):
            self.ops.clear()
            length: dict[int, int] = {}
            pre, _ = self._step(length, list(range(self.k)), [])
            steps = [self._step(length, [], list(range(self.k)))[1] for _ in range(self.out - 1)]
            got.append({"prompt_s": pre, "short_s": 0.0, "decode_s": sum(steps), "decode_steps": len(steps),
                        "short_calls": 0, "rows": (self.out - 1) * self.k})
        return got

    def staggered(self, cycles: int) -> list[dict]:
        k, end = self.k, self.prompt + self.out - 1     # a sequence ends at its last output token
        self.ops.clear()
        length: dict[int, int] = {}
        for s in range(k):                              # the steady state's spacing: out / k tokens apart
            self._step(length, [s], sorted(length))
            for _ in range(max(1, self.out // k) - 1 if s < k - 1 else 0):
                self._step(length, [], sorted(length))
        got = []
        for cyc in range(cycles + 1):
            pre = short = dec = 0.0
            steps = calls = rows = ended = 0
            while ended < k:
                seqs = sorted(length)
                dec += self._step(length, [], seqs)[1]
                steps, rows = steps + 1, rows + len(seqs)
                for s in [s for s in seqs if length[s] >= end]:
                    self.ops.drop(s)
                    del length[s]
                    others = sorted(length)
                    p, r = self._step(length, [s], others)
                    pre, short = pre + p, short + r
                    calls, rows = calls + bool(others), rows + len(others)
                    ended += 1
            if cyc:                                        # the first cycle reaches the steady state
                got.append({"prompt_s": pre, "short_s": short, "decode_s": dec, "decode_steps": steps,
                            "short_calls": calls, "rows": rows})
        return got


def total(x: dict) -> float:
    return x["prompt_s"] + x["short_s"] + x["decode_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=2, help="cycles a schedule a round")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--via", choices=("raw", "raw-aside", "executor", "executor-aside"), default="raw",
                    help="raw llama_decode calls (raw-aside: a lone prompt computed in a second context and "
                         "copied in), or localinfer's LlamaCppExecutor (split_short, compaction; executor-aside: "
                         "with its second context for lone prompts)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if min(args.rounds, args.cycles, args.prompt_tokens, args.threads) < 1 or args.output_tokens < 2:
        ap.error("--rounds, --cycles, --prompt-tokens and --threads must be at least 1, --output-tokens at least 2")
    if not 1 <= args.concurrency <= 8 or args.concurrency * (args.prompt_tokens + args.output_tokens) > 4096:
        ap.error("--concurrency must be 1-8, and its sequences must fit 4096 cells")
    model = str(resolve_model(args.model))
    if args.via.startswith("executor"):
        ops = Executor(model, args.threads, aside=args.via == "executor-aside")
    else:
        aside = Context(model, args.threads, cells=1024) if args.via == "raw-aside" else None
        ops = Raw(Context(model, args.threads), aside)
    cyc = Cycles(ops, args.concurrency, args.prompt_tokens, args.output_tokens)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rounds = []
    for r in range(args.rounds):
        order = ("waves", "staggered") if r % 2 == 0 else ("staggered", "waves")
        got = {name: getattr(cyc, name)(args.cycles) for name in order}
        row = {"round": r + 1, "order": list(order), **got}
        rounds.append(row)
        w, s = (statistics.fmean(map(total, got[n])) for n in ("waves", "staggered"))
        print(f"round {r + 1} ({'/'.join(order)}): a cycle waves {w:.3f} s, staggered {s:.3f} s = {s / w:.3f}x",
              flush=True)
    med = {}
    for name in ("waves", "staggered"):
        xs = [x for r in rounds for x in r[name]]
        med[name] = {f: round(statistics.median(x[f] for x in xs), 4)
                     for f in ("prompt_s", "short_s", "decode_s", "decode_steps", "short_calls", "rows")}
        med[name]["cycle_s"] = round(statistics.median(map(total, xs)), 4)
        m = med[name]
        print(f"{name:>9}: a cycle {m['cycle_s']:.3f} s = prompts {m['prompt_s']:.3f} + rows beside them "
              f"{m['short_s']:.3f} ({m['short_calls']:.0f} calls) + {m['decode_steps']:.0f} decode steps "
              f"{m['decode_s']:.3f} ({m['decode_s'] / m['decode_steps'] * 1e3:.1f} ms a step); "
              f"{m['rows']:.0f} decode rows")
    ratio = med["staggered"]["cycle_s"] / med["waves"]["cycle_s"]
    print(f"staggered over waves: {ratio:.3f}x a cycle (medians over {args.rounds} rounds of {args.cycles})")
    if args.json:
        doc = {"machine": machine(), "when": when, "model": Path(model).name, "threads": args.threads,
               "concurrency": args.concurrency, "via": args.via,
               "prefill_aside": args.via.endswith("aside"), "prompt_tokens": args.prompt_tokens,
               "output_tokens": args.output_tokens, "context": {"cells": 4096, "sequences": 8, "kv_unified": True,
                                                                "n_ubatch": 512, "flash_attn": True},
               "rounds": rounds, "median": med, "staggered_over_waves": round(ratio, 4)}
        atomic_write(args.json, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
