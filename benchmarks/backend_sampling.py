"""Greedy tokens drawn inside llama.cpp's graph (backend sampling) against the serving engine's way (the logits
row read on the host, its argmax in numpy), one decode step at a time, alternated in one process (issue 45).

    python benchmarks/backend_sampling.py [--rows 1] [--steps 300] [--gpu-layers 0] [--model PATH] [--json OUT]

Two contexts over one loaded model, the serving executor's settings (4096 cells in one unified stream, 16
sequence ids, flash attention, ``--threads``): context A has no backend sampler, and each step reads every row's
logits (``llama_get_logits_ith``) and takes its argmax, banning the end-of-generation tokens as a request with
``ignore_eos`` does (a second argmax only when one of them wins); context B has a sampler chain on every sequence id
(``llama_set_sampler``: logit bias -inf on those tokens, then greedy), so its graph ends in an argmax per row and
``llama_get_sampled_token_ith`` reads the token, no logits row copied.  Both decode the same ``--rows`` sequences
(a 300-token prompt each, then one token a step), A and B alternated with their order swapped each step, so the
machine's drift falls on both; each step's time is the draw plus the ``llama_decode`` that follows, synchronized
(on a GPU the decode returns before its graph has run).  Prints the medians, B/A, and whether both drew the same
tokens; and the time a change of one sequence's sampler takes with the decode after it (``llama_set_sampler``
initialises the chain on the device and has llama.cpp reserve its graphs again at that decode; a chain cannot be
attached twice, so each change takes a new one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import llama_cpp as _L
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.model.sources import default_model_path    # noqa: E402

N_SEQ = 16
PROMPT = 300
N_CTX = 4096          # cells, one unified stream for all sequences
CHANGES = 6           # sampler changes timed at the end, a decode each


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--rows", type=int, default=1, help="sequences decoding together (default 1)")
    ap.add_argument("--steps", type=int, default=300, help="steps of each context (default 300)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.rows <= N_SEQ or args.steps < 2 or args.threads < 1:
        ap.error(f"--rows must be 1..{N_SEQ}, --steps at least 2 and --threads at least 1")
    if args.rows * (PROMPT + args.steps + CHANGES) > N_CTX:
        ap.error(f"--rows {args.rows} x ({PROMPT} prompt + {args.steps} steps + {CHANGES}) positions exceed the "
                 f"context's {N_CTX} cells: fewer rows or steps")
    model_path = args.model or str(default_model_path())
    _L.llama_backend_init()
    mp = _L.llama_model_default_params()
    mp.n_gpu_layers = args.gpu_layers
    model = _L.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise SystemExit(f"could not load {model_path}")
    vocab = _L.llama_model_get_vocab(model)
    n_vocab = _L.llama_vocab_n_tokens(vocab)
    eog = [t for t in range(n_vocab) if _L.llama_vocab_is_eog(vocab, t)]     # what ignore_eos bans
    banned = frozenset(eog)
    batch = _L.llama_batch_init(512, 0, 1)
    chains: list = []

    def context():
        cp = _L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = N_CTX, 512, 512, N_SEQ
        cp.n_threads = cp.n_threads_batch = args.threads
        cp.flash_attn_type, cp.kv_unified = _L.LLAMA_FLASH_ATTN_TYPE_ENABLED, True
        ctx = _L.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit("could not make a llama.cpp context")
        return ctx

    def chain():
        ch = _L.llama_sampler_chain_init(_L.llama_sampler_chain_default_params())
        bias = (_L.llama_logit_bias * len(eog))(*(_L.llama_logit_bias(t, float("-inf")) for t in eog))
        _L.llama_sampler_chain_add(ch, _L.llama_sampler_init_logit_bias(n_vocab, len(eog), bias))
        _L.llama_sampler_chain_add(ch, _L.llama_sampler_init_greedy())
        chains.append(ch)
        return ch

    def decode(ctx, rows: list[tuple[int, int, int]], last_only: bool) -> None:
        """rows: (token, position, seq); logits for the batch's last row (``last_only``) or for every row; waits
        for the graph."""
        for i, (tok, pos, seq) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = (not last_only) or i == len(rows) - 1
        batch.n_tokens = len(rows)
        if _L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        _L.llama_synchronize(ctx)

    def host_draw(ctx, i: int) -> int:
        row = np.ctypeslib.as_array(_L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        tok = int(np.argmax(row))
        if tok in banned:
            masked = row.copy()
            masked[eog] = -np.inf
            tok = int(np.argmax(masked))
        return tok

    def backend_draw(ctx, i: int) -> int:
        tok = int(_L.llama_get_sampled_token_ith(ctx, i))
        if tok < 0:        # the chain was attached but its ops do not run on this device: no token, no logits
            raise SystemExit("this llama.cpp cannot run the greedy chain in the graph on this device")
        return tok

    a, b = context(), context()
    for seq in range(N_SEQ):
        if not _L.llama_set_sampler(b, seq, chain()):
            raise SystemExit("this llama.cpp cannot run the greedy chain in the graph")
    ctxs = {"host": (a, host_draw), "backend": (b, backend_draw)}
    nxt: dict[str, list[int]] = {}
    for name, (ctx, draw) in ctxs.items():
        rng = np.random.default_rng(7)       # the same prompts for both
        nxt[name] = []
        for seq in range(args.rows):
            prompt = rng.integers(100, n_vocab - 100, PROMPT)
            decode(ctx, [(int(t), p, seq) for p, t in enumerate(prompt)], last_only=True)
            nxt[name].append(draw(ctx, PROMPT - 1))
    times: dict[str, list[float]] = {"host": [], "backend": []}
    drawn: dict[str, list[tuple[int, ...]]] = {"host": [], "backend": []}
    for step in range(args.steps):
        order = ("host", "backend") if step % 2 == 0 else ("backend", "host")
        for name in order:
            ctx, draw = ctxs[name]
            t = time.perf_counter()
            if step:
                nxt[name] = [draw(ctx, i) for i in range(args.rows)]
            decode(ctx, [(nxt[name][s], PROMPT + step, s) for s in range(args.rows)], last_only=False)
            times[name].append(time.perf_counter() - t)
            drawn[name].append(tuple(nxt[name]))
    same = drawn["host"] == drawn["backend"]
    # changing one sequence's sampler, and the decode after it (llama.cpp reserves its graphs again there)
    change = []
    pos = PROMPT + args.steps
    for k in range(CHANGES):
        new = None if k % 2 == 0 else chain()
        t = time.perf_counter()
        if not _L.llama_set_sampler(b, 0, new):
            raise SystemExit("llama_set_sampler refused a change")
        decode(b, [(nxt["backend"][s], pos, s) for s in range(args.rows)], last_only=False)
        change.append(time.perf_counter() - t)
        pos += 1
    steady = statistics.median(times["backend"][1:])
    ratios = [tb / ta for ta, tb in zip(times["host"][1:], times["backend"][1:])]
    out = {
        "model": os.path.basename(model_path), "rows": args.rows, "steps": args.steps, "threads": args.threads,
        "gpu_layers": args.gpu_layers, "host_ms": statistics.median(times["host"][1:]) * 1e3,
        "backend_ms": steady * 1e3, "backend_over_host": statistics.median(ratios), "same_tokens": same,
        "sampler_change_and_decode_ms": [round(x * 1e3, 3) for x in change],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"{out['model']}, {args.rows} row(s), {args.threads} threads, {args.gpu_layers} GPU layers: "
          f"a step with the host draw {out['host_ms']:.3f} ms, with the graph's draw {out['backend_ms']:.3f} ms; "
          f"graph/host median {out['backend_over_host']:.4f}; same tokens: {same}; "
          f"a sampler change and the decode after it {statistics.median(change) * 1e3:.2f} ms "
          f"(a step {steady * 1e3:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    _L.llama_free(a)
    _L.llama_free(b)
    for ch in chains:
        _L.llama_sampler_free(ch)
    _L.llama_batch_free(batch)
    _L.llama_model_free(model)
    _L.llama_backend_free()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
