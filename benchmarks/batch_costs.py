"""What a token costs by how many sequences share a ``llama_decode`` call: k prompts prefilled in one call, then
k rows decoded together (issue 45: how much a closed loop's output rate can depend on how a server orders it).

    python benchmarks/batch_costs.py [MODEL] [--threads 2] [--rounds 3] [--prompt-tokens 300] [--json OUT]

One llama.cpp context as ``serve_peers.py`` runs both servers: 4096 cells in one unified pool, 8 sequences,
flash attention on, ``n_ubatch`` 512, ``--threads`` threads.  For k in 1, 2, 4, 8 (the order rotated each round):
the cache is cleared, k random-token prompts of ``--prompt-tokens`` go in one call (logits for each prompt's last
token only; the batch is as large as the k prompts, so llama.cpp cuts it only into ubatches: llama-server's
synchronised wave), then ``--steps`` decode steps of k rows, one token a sequence, then the first sequence is
removed and a new prompt prefilled alone beside the k - 1 others' cells (a staggered server's prompt step, here
without the decode rows such a step also carries).  Printed: prefill ms a prompt token both ways, decode ms a step
and a row, each the median over the rounds; each figure is one call's (prefill) or ``--steps`` calls' median
(decode), so compare them within a round's spread.  In process, no server: where a prompt token costs the same in
every arrangement, a schedule changes a closed loop's compute only through the rows its decode tokens run in.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.loadgen.load import machine             # noqa: E402
from localinfer.model.sources import resolve_model      # noqa: E402
from localinfer.util.atomic import atomic_write          # noqa: E402

SEQS = (1, 2, 4, 8)


class Context:
    """A llama.cpp context and a batch big enough for every prompt at once."""

    def __init__(self, model_path: str, threads: int, cells: int = 4096):
        import llama_cpp as L

        from localinfer.backends.llamacpp import native
        self.L = L
        native.init_backend()          # llama.cpp's log to localinfer's handler (quiet unless LOCALINFER_LLAMA_LOG)
        self.model = L.llama_model_load_from_file(model_path.encode(), L.llama_model_default_params())
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = cells, cells, 512, max(SEQS), True
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(cells, 0, max(SEQS))

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> float:
        """One call over (token, position, sequence, wants logits) rows; its seconds."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        t0 = time.perf_counter()
        rc = self.L.llama_decode(self.ctx, b)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return dt


def one(c: Context, k: int, prompt: int, steps: int, rng: random.Random) -> dict:
    """k prompts in one call, then ``steps`` decode steps of k rows."""
    c.L.llama_memory_clear(c.mem, True)
    tok = lambda: rng.randrange(100, 40000)      # noqa: E731
    prefill = c.decode([(tok(), p, s, p == prompt - 1) for s in range(k) for p in range(prompt)])
    step = [c.decode([(tok(), prompt + i, s, True) for s in range(k)]) for i in range(steps)]
    c.L.llama_memory_seq_rm(c.mem, 0, -1, -1)
    beside = c.decode([(tok(), p, 0, p == prompt - 1) for p in range(prompt)])
    return {"k": k, "prefill_ms_a_token": prefill / (k * prompt) * 1e3, "beside_ms_a_token": beside / prompt * 1e3,
            "step_ms": statistics.median(step) * 1e3, "row_ms": statistics.median(step) / k * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if min(args.rounds, args.steps, args.prompt_tokens, args.threads) < 1:
        ap.error("--rounds, --steps, --prompt-tokens and --threads must each be at least 1")
    if args.prompt_tokens * max(SEQS) + args.steps * max(SEQS) > 4096:
        ap.error("8 prompts and their decode steps must fit 4096 cells")
    model = str(resolve_model(args.model))
    c = Context(model, args.threads)
    rng = random.Random(0)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for r in range(args.rounds):
        order = SEQS[r % len(SEQS):] + SEQS[:r % len(SEQS)]
        for k in order:
            rows.append({"round": r + 1, **one(c, k, args.prompt_tokens, args.steps, rng)})
            x = rows[-1]
            print(f"round {r + 1}  k={k}  prefill {x['prefill_ms_a_token']:.2f} ms a token, one beside k-1 "
                  f"{x['beside_ms_a_token']:.2f}  decode "
                  f"{x['step_ms']:.1f} ms a step, {x['row_ms']:.2f} a row", flush=True)
    med = {k: {f: round(statistics.median(x[f] for x in rows if x["k"] == k), 2)
               for f in ("prefill_ms_a_token", "beside_ms_a_token", "step_ms", "row_ms")} for k in SEQS}
    print("median over rounds:")
    for k, m in med.items():
        print(f"  k={k}  prefill {m['prefill_ms_a_token']:.2f} ms a token, one beside k-1 "
              f"{m['beside_ms_a_token']:.2f}  decode {m['step_ms']:.1f} ms a step, "
              f"{m['row_ms']:.2f} a row  ({m['row_ms'] / med[1]['row_ms']:.2f}x one row alone)")
    if args.json:
        doc = {"machine": machine(), "when": when, "model": Path(model).name, "threads": args.threads,
               "context": {"cells": 4096, "sequences": max(SEQS), "kv_unified": True, "n_ubatch": 512,
                           "flash_attn": True},
               "prompt_tokens": args.prompt_tokens, "steps": args.steps, "rows": rows,
               "median": {str(k): v for k, v in med.items()}}
        atomic_write(args.json, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
