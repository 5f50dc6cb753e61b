"""Structured output costs: grammar mask + apply per token per row, and serve tok/s with a JSON schema vs without.

    python benchmarks/structured.py [--out benchmarks/results/structured_cpu.json] [--beside] [--engine]
        [--serve [--llama-server "$(scripts/build_llama_server.sh)"]] [--threads 2]

1. Mask + apply: JSON-schema replies are walked token by token (each step draws the likeliest allowed token of
   random logits, so every state a reply passes through is timed), for the embedded model's 49,152-token
   vocabulary, three generated 152,064-token ones (the size of Qwen2's: the 49k pieces plus concatenations of
   two of them: the pairs a BPE trainer would merge next in this Python's standard library sources; pairs whose
   lengths are drawn from the 49k's own, so as many long tokens as a real vocabulary but random prefixes; and a
   stress case, any two pieces, 54% of its tokens over 10 bytes) and, where ``scripts/llama_sources.sh`` has unpacked
   llama.cpp's sources, Qwen2's own 151,936-token vocabulary (its ``ggml-vocab-qwen2.gguf`` test file: 10% over
   10 bytes).  A step is ``fill_masks`` (the serving step's batched llguidance call, GIL released) plus
   ``Constraint.apply`` (bits to −inf logits) for each row; batch 1 and batch 8 (eight replies with eight
   schemas filled in one call, the time divided by 8).  Wall time and the calling thread's CPU time (with one
   mask thread the fill runs in it; on a shared machine wall-time tails are other processes' time slices);
   fill and apply apart; and the slowest 1% of steps again, each state on a fresh matcher (first visit or the
   state's own cost) with the reply's text before it.
2. ``--beside``: the masks' share of a step's critical path with a real forward pass: the same walks, each
   step's fill started before one decode step of the embedded model (llama.cpp, ``--threads``) and waited for
   after it, as the serving engine does (``StepMasks``), against the fill after the forward pass; per row,
   (wait + apply) / batch, and the forward pass's own time.
3. ``--draws``: the grammar's part of each token of the embedded model's replies to the serve prompts (one at a
   time, llama.cpp, ``--threads``): the draw tried without the mask first, kept where the grammar allows it,
   against the mask applied first; greedy and temperature 1; how many tokens needed a mask.
4. ``--engine``: the step engine in process (llama.cpp, ``--threads``, per-slot KV, no HTTP), batches of 1, 4
   and 8 greedy requests with the serve schema's grammar, its masks filled beside the forward pass and after it,
   and without a grammar, in turn, ``max_tokens`` each (EOS banned): tok/s ratios, the CPU milliseconds per
   token the grammar adds, and each step's wait for its masks.
5. ``--serve``: ``localinfer serve`` and, with ``--llama-server PATH``, llama.cpp's llama-server (which turns
   ``response_format`` json_schema into a GBNF grammar), one after the other, each on the embedded model with
   ``--threads`` threads, 8192 cells over 8 slots, flash attention: closed-loop clients at concurrency 1, 4 and
   8, the same prompts with ``response_format`` json_schema and without, in the order A B B A; completion tokens
   per second, with over without (each reply that completes is validated against the schema), ``--repeats``
   times, the servers' order rotated, and the median ratio; the load average beside every run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localinfer.generation.constraints import Constraint, fill_masks, grammar_from, grammar_tokenizer
from localinfer.util.atomic import atomic_write

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 6}}, "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 8, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "price": {"type": "number"},
                                         "label": {"enum": ["new", "used", "refurbished"]}},
        "required": ["id", "price", "label"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "when": {"type": "string", "format": "date"},
                                      "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 60}]}},
     "required": ["code", "when", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 10}}}}}}, "required": ["a"]},
]
SCHEMAS = SCHEMAS + SCHEMAS                                     # eight replies in the batch-8 runs


class SyntheticVocab:
    """A 152k vocabulary: the embedded model's pieces, then concatenations of two of them.

    ``lengths="merges"``: the pairs a BPE trainer would merge next (:func:`merged_pairs`), so the added tokens
    share prefixes as a real vocabulary's do.  ``lengths="pairs"``: any two pieces, so the added tokens are about twice as long as the pieces (54% of the
    vocabulary over 10 bytes; a stress case no real tokenizer has).  ``lengths="matched"``: each added token's
    length in bytes is drawn from the embedded vocabulary's own lengths and made of two pieces that add up to it,
    so the whole vocabulary has the length profile of a real BPE vocabulary (11% over 10 bytes; Qwen2's 152k:
    10%) but random prefixes (seeded).
    """

    def __init__(self, base, n_vocab: int = 152_064, seed: int = 0, lengths: str = "merges"):
        self.base, self.n_vocab = base, n_vocab
        self.eos_ids, self.bos_id = base.eos_ids, base.bos_id
        rng = np.random.default_rng(seed)
        plain = [i for i in range(base.n_vocab) if base.token_bytes(i)]
        want = n_vocab - base.n_vocab
        if lengths == "merges":
            self.extra = merged_pairs(base, want)
            return
        if lengths == "pairs":
            pairs = rng.choice(plain, size=(want, 2))
            self.extra = [base.token_bytes(int(a)) + base.token_bytes(int(b)) for a, b in pairs]
            return
        if lengths != "matched":
            raise ValueError(f"lengths must be 'merges', 'matched' or 'pairs', got {lengths!r}")
        pieces = [base.token_bytes(i) for i in plain]
        by_len: dict[int, list[bytes]] = {}
        for b in pieces:
            by_len.setdefault(len(b), []).append(b)
        seen, self.extra = set(pieces), []
        targets = np.array([len(b) for b in pieces if len(b) >= 2])
        while len(self.extra) < want:
            for n in rng.choice(targets, size=want):
                head = int(rng.integers(1, n))           # the first piece's length, the second's is the rest
                if head not in by_len or n - head not in by_len:
                    continue
                a, b = by_len[head], by_len[n - head]
                tok = a[int(rng.integers(len(a)))] + b[int(rng.integers(len(b)))]
                if tok not in seen:
                    seen.add(tok)
                    self.extra.append(tok)
                    if len(self.extra) == want:
                        break

    def token_bytes(self, i: int) -> bytes:
        return self.base.token_bytes(i) if i < self.base.n_vocab else self.extra[i - self.base.n_vocab]

    def token_text(self, i: int) -> str:
        return self.base.token_text(i) if i < self.base.n_vocab else self.token_bytes(i).decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.base.tokenize(text, add_bos=add_bos, special=special)


def merged_pairs(base, n: int, corpus_bytes: int = 12 << 20) -> list[bytes]:
    """``n`` new tokens as a BPE trainer would add them next: the ``n`` most frequent adjacent pairs of the
    embedded vocabulary's tokens in a corpus (this Python's standard library sources, the first ``corpus_bytes``
    in sorted order), each pair's bytes one token, none that the vocabulary already has."""
    import collections
    import itertools
    import sysconfig

    root, files = sysconfig.get_paths()["stdlib"], []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "__pycache__", "idlelib"))
        files += [os.path.join(d, f) for f in sorted(names) if f.endswith(".py")]
    pairs, read = collections.Counter(), 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        ids = base.tokenize(text)
        pairs.update(itertools.pairwise(ids))
        read += len(text)
        if read >= corpus_bytes:
            break
    seen = {base.token_bytes(i) for i in range(base.n_vocab)}
    out = []
    for (a, b), _ in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
        tok = base.token_bytes(a) + base.token_bytes(b)
        if tok not in seen:
            seen.add(tok)
            out.append(tok)
            if len(out) == n:
                return out
    raise ValueError(f"the corpus gave {len(out)} new pairs, not {n}")


def long_share(vocab, over: int = 10) -> float:
    """The share of a vocabulary's tokens longer than ``over`` bytes."""
    return round(sum(len(vocab.token_bytes(i)) > over for i in range(vocab.n_vocab)) / vocab.n_vocab, 3)


def _advance(cs, masked, vocab, tok, grammars) -> None:
    """Each reply takes its most likely allowed token (EOS banned); one that ended, or has no token left, or ran
    past 400 tokens starts again on a fresh matcher of its grammar."""
    for i, (c, m) in enumerate(zip(cs, masked)):
        ok = np.isfinite(m)
        ok[list(vocab.eos_ids)] = False
        if c.stopped_after(len(c.tokens)) or not ok.any() or len(c.tokens) > 400:
            cs[i] = Constraint(tok, grammars[i])
            continue
        c.consume(int(np.argmax(np.where(ok, m, -np.inf))))

def qwen2_vocab_path() -> str | None:
    """llama.cpp's Qwen2 vocabulary test file (151,936 real tokens, no weights) in the llama-cpp-python sdist that
    ``scripts/llama_sources.sh`` unpacked, if it has been (it does not download it here)."""
    import llama_cpp
    cache = Path(os.environ.get("LOCALINFER_CACHE", Path.home() / ".cache" / "localinfer"))
    path = cache / f"llama-src-{llama_cpp.__version__}" / "src" / "vendor" / "llama.cpp" / "models" / "ggml-vocab-qwen2.gguf"
    return str(path) if path.exists() else None


def _q(a, p) -> float:
    return round(float(np.percentile(a, p)), 4)


def mask_costs(vocab, batch: int, steps: int, seed: int = 0) -> dict:
    """Per-row cost of one step's fill + apply, over ``steps`` steps of ``batch`` replies (restarted when done).

    A step is timed as a whole (``fill_masks`` for the batch, then ``Constraint.apply`` for each row) and divided
    by the batch.  Fill and apply are also timed apart, and the steps in the top 1% are looked at again: the same
    state on a fresh matcher (walked there by the same tokens, so none of llguidance's caches is warm) says whether
    a slow mask is a first visit or the state's own cost; the text just before says where in the reply it was."""
    tok = grammar_tokenizer(vocab)
    grammars = [grammar_from("json_schema", s, "schema") for s in SCHEMAS[:batch]]
    rng = np.random.default_rng(seed)
    cs = [Constraint(tok, g) for g in grammars]
    wall, cpu, fill_cpu, apply_cpu, gcs, where = [], [], [], [], [], []
    collections = [0]

    def on_gc(phase, info):
        collections[0] += phase == "start"

    logits = [rng.standard_normal(vocab.n_vocab).astype(np.float32) for _ in cs]     # the executor's rows
    gc.callbacks.append(on_gc)
    try:
        for _ in range(steps):
            for x in logits:
                x[rng.integers(0, vocab.n_vocab, 64)] += 4.0                      # a different argmax each step
            g0 = collections[0]
            c0, t0 = time.thread_time(), time.perf_counter()
            fill_masks([(c, c.tokens, ()) for c in cs])
            c1 = time.thread_time()
            masked = [c.apply(x) for c, x in zip(cs, logits)]
            t2, c2 = time.perf_counter(), time.thread_time()
            wall.append((t2 - t0) / len(cs))
            cpu.append((c2 - c0) / len(cs))
            fill_cpu.append((c1 - c0) / len(cs))
            apply_cpu.append((c2 - c1) / len(cs))
            gcs.append(collections[0] - g0)
            where.append([(i, np.array(c.tokens, dtype=np.int32)) for i, c in enumerate(cs)])   # not GC-tracked
            _advance(cs, masked, vocab, tok, grammars)
    finally:
        gc.callbacks.remove(on_gc)
    ms, cms = np.array(wall) * 1e3, np.array(cpu) * 1e3
    fms, ams = np.array(fill_cpu) * 1e3, np.array(apply_cpu) * 1e3
    slow = []
    for k in np.argsort(-cms)[:max(1, steps // 100)]:
        rows = []
        for i, tokens in where[k]:                       # the same states on fresh matchers
            m = Constraint(tok, grammars[i]).matcher
            m.consume_tokens(tokens.tolist())
            buf = np.zeros(cs[0].words, dtype=np.int32)
            f0 = time.thread_time()
            m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            rows.append((time.thread_time() - f0) * 1e3)
            m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        i, tokens = max(where[k], key=lambda w: len(w[1]))
        slow.append({"step": int(k), "cpu_ms": round(float(cms[k]), 3), "fill_ms": round(float(fms[k]), 3),
                     "apply_ms": round(float(ams[k]), 3), "gc": gcs[k], "fresh_fill_ms": round(sum(rows) / len(rows), 3),
                     "tokens_in": len(tokens), "text_before": tok.decode_str(tokens.tolist())[-40:]})
    return {"vocab": vocab.n_vocab, "batch": batch, "steps": steps, "p50_ms": _q(ms, 50), "p99_ms": _q(ms, 99),
            "mean_ms": round(float(ms.mean()), 4), "cpu_p50_ms": _q(cms, 50), "cpu_p99_ms": _q(cms, 99),
            "fill_cpu_p50_ms": _q(fms, 50), "fill_cpu_p99_ms": _q(fms, 99), "apply_cpu_p50_ms": _q(ams, 50),
            "apply_cpu_p99_ms": _q(ams, 99), "steps_with_gc": int(sum(g > 0 for g in gcs)), "slowest": slow}


def mask_beside_forward(vocab, batch: int, steps: int, threads: int, seed: int = 0) -> dict:
    """The masks' share of a step's critical path with a real forward pass: ``mask_costs``'s walk over ``vocab``,
    each step's fill started before one decode step of the embedded model for ``batch`` sequences (llama.cpp,
    ``threads`` threads) and waited for after it (``StepMasks``, as the engine does), then applied; and the same
    walk with the fill after the forward pass.  The two walks go in lockstep (same seed, same states), a step of
    each in turn.  Per row: (wait + apply) / batch, wall time; and the forward pass's own wall time, which the
    fill beside it may lengthen where it has no core of its own."""
    from localinfer.backends.executor import Chunk
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.model.sources import default_model_path
    from localinfer.serve.masks import StepMasks

    tok = grammar_tokenizer(vocab)
    grammars = [grammar_from("json_schema", s, "schema") for s in SCHEMAS[:batch]]
    modes = {"beside": StepMasks(True), "after": StepMasks(False)}
    walks = {mode: ([Constraint(tok, g) for g in grammars], np.random.default_rng(seed)) for mode in modes}
    rows = {mode: [rng.standard_normal(vocab.n_vocab).astype(np.float32) for _ in grammars]
            for mode, (_, rng) in walks.items()}
    path = {mode: [] for mode in modes}
    forward = {mode: [] for mode in modes}
    with LlamaCppExecutor.open(default_model_path(), n_slots=2 * batch, n_ctx=2 * batch * 1024, threads=threads,
                               flash_attn=True, unified=False) as ex:
        prompt = tuple(ex.engine.tokenize("Describe a film as JSON.", add_bos=True))
        got = ex.step([Chunk(s, prompt, 0, True) for s in range(2 * batch)])
        last = {s: int(np.argmax(got[s])) for s in got}
        pos = len(prompt)
        for _ in range(steps):
            for k, (mode, masks) in enumerate(modes.items()):
                cs, rng = walks[mode]
                slots = range(k * batch, (k + 1) * batch)
                for x in rows[mode]:
                    x[rng.integers(0, vocab.n_vocab, 64)] += 4.0
                masks.start([(c, c.tokens, ()) for c in cs])
                t0 = time.perf_counter()
                got = ex.step([Chunk(s, (last[s],), pos, True) for s in slots])
                t1 = time.perf_counter()
                masks.finish()
                masked = [c.apply(x) for c, x in zip(cs, rows[mode])]
                t2 = time.perf_counter()
                forward[mode].append(t1 - t0)
                path[mode].append((t2 - t1) / batch)
                last.update({s: int(np.argmax(got[s])) for s in slots})
                _advance(cs, masked, vocab, tok, grammars)
            pos += 1
    for masks in modes.values():
        masks.close()
    out = {"vocab": vocab.n_vocab, "batch": batch, "steps": steps, "threads": threads}
    for mode in modes:
        ms, fw = np.array(path[mode]) * 1e3, np.array(forward[mode]) * 1e3
        out[mode] = {"p50_ms": _q(ms, 50), "p99_ms": _q(ms, 99), "forward_p50_ms": _q(fw, 50),
                     "forward_mean_ms": round(float(fw.mean()), 3)}
    return out


SERVE_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "genres": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 5},
    "summary": {"type": "string", "maxLength": 200}}, "required": ["title", "year", "genres", "summary"],
    "additionalProperties": False}
TOPICS = ["a film about the sea", "a film about space", "a comedy set in Paris", "a war drama", "a heist film",
          "a love story in Rome", "a documentary about bees", "a horror film in a forest"]


@contextlib.contextmanager
def started(kind: str, llama_server: str | None, threads: int, ctx: int = 8192, parallel: int = 8):
    """A ready server's base URL: ``localinfer serve`` or llama-server, on the embedded model, ``threads`` threads,
    ``ctx`` cells of context over ``parallel`` slots, flash attention on (``benchmarks/serve_peers.py``'s flags)."""
    from localinfer.loadgen.local_serve import LocalServe
    from localinfer.model.sources import default_model_path

    if kind == "localinfer":
        with LocalServe(None, threads=threads, ctx=ctx, parallel=parallel, extra=["-fa", "on"]) as url:
            yield url
        return
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [llama_server, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx),
           "-np", str(parallel), "--kv-unified", "--no-webui", "-t", str(threads), "-tb", str(threads), "-fa", "on"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    sys.exit(f"llama-server exited with {proc.returncode}: {log.read()[-800:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    sys.exit("llama-server was not ready within 300 s")
                time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve_rates(url: str, levels: list[int], requests: int, max_tokens: int) -> list[dict]:
    """Closed-loop clients at each concurrency, the same prompts without a schema and with it, in the order A B B A
    (a drift in the machine's load hits both): completion tokens per second, the load average beside each run.

    Every run sends the same ``requests`` prompts (the topics in turn), the clients taking the next one as they
    finish, so each level and each way measures the same replies."""
    import httpx
    import jsonschema

    def body(i: int, schema: bool) -> dict:
        b = {"model": "x", "max_tokens": max_tokens, "temperature": 0, "messages": [
            {"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON with title, year, "
                                        "genres and summary."}]}
        if schema:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "film", "schema": SERVE_SCHEMA}}
        return b

    out = []
    model = httpx.get(url + "/models", timeout=10).json()["data"][0]["id"]
    for i in range(len(TOPICS)):            # warm-up: every prompt once each way, so no run pays the others' prefills
        for schema in (True, False):
            httpx.post(url + "/chat/completions", json={**body(i, schema), "model": model, "max_tokens": 4},
                       timeout=120).raise_for_status()
    for conc in levels:
        for schema in (False, True, True, False):
            tokens, done, invalid, lock = [0], [0], [0], threading.Lock()
            todo = iter(range(requests))

            def client(k: int, schema=schema, tokens=tokens, done=done, invalid=invalid, lock=lock, todo=todo) -> None:
                with httpx.Client(timeout=300) as c:
                    while (i := next(todo, None)) is not None:       # next() on a range iterator holds the GIL
                        reply = c.post(url + "/chat/completions", json={**body(i, schema), "model": model})
                        reply.raise_for_status()
                        j = reply.json()
                        with lock:
                            tokens[0] += j["usage"]["completion_tokens"]
                            if schema and j["choices"][0]["finish_reason"] == "stop":   # complete: valid?
                                try:
                                    jsonschema.validate(json.loads(j["choices"][0]["message"]["content"]),
                                                        SERVE_SCHEMA)
                                    done[0] += 1
                                except (ValueError, jsonschema.ValidationError):
                                    invalid[0] += 1

            t0 = time.perf_counter()
            ts = [threading.Thread(target=client, args=(k,)) for k in range(conc)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            wall = time.perf_counter() - t0
            out.append({"concurrency": conc, "schema": schema, "requests": requests,
                        "completion_tokens": tokens[0], "seconds": round(wall, 3), "tok_s": round(tokens[0] / wall, 2),
                        "loadavg_1": round(os.getloadavg()[0], 2), **({"complete_json": done[0], "invalid_json": invalid[0]} if schema else {})})
            print(out[-1], file=sys.stderr)
    return out


def serve_ratios(runs: list[dict], levels: list[int]) -> dict[str, float]:
    """Per concurrency: tok/s with the schema over tok/s without, over the runs of each."""
    def rate(c, schema):
        rs = [r for r in runs if r["concurrency"] == c and r["schema"] == schema]
        return sum(r["completion_tokens"] for r in rs) / sum(r["seconds"] for r in rs)

    return {str(c): round(rate(c, True) / rate(c, False), 3) for c in levels}


MODES = {"none": (False, True), "schema": (True, True), "schema serial": (True, False)}   # (grammar, overlap)


def engine_rates(levels: list[int], max_tokens: int, threads: int, repeats: int = 3) -> list[dict]:
    """The step engine in process on llama.cpp (per-slot KV), no HTTP: wall and CPU seconds of the same batch
    without a grammar, with the serve schema's grammar on every request filled beside the forward pass (the
    engine's default), and filled after it, in turn; per step, how long the step waited for its masks once the
    logits were back (``StepMasks.wait_s``)."""
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.model.sources import default_model_path
    from localinfer.serve.block_manager import BlockManager
    from localinfer.serve.engine import StepEngine
    from localinfer.serve.http.sampler import ServeRequest
    from localinfer.serve.request import GREEDY
    from localinfer.serve.scheduler import Scheduler, SchedulerConfig

    out = []
    with LlamaCppExecutor.open(default_model_path(), n_slots=8, n_ctx=4096, threads=threads, flash_attn=True,
                               unified=False) as ex:
        tok = grammar_tokenizer(ex.engine)
        grammar = grammar_from("json_schema", SERVE_SCHEMA, "schema")
        prompts = [tuple(ex.engine.tokenize(f"Describe {t} as JSON with title, year, genres and summary.",
                                            add_bos=True)) for t in TOPICS]
        for conc in levels:
            for _ in range(repeats):
                for mode, (schema, overlap) in MODES.items():
                    for slot in range(ex.n_slots):
                        ex.drop(slot)
                    e = StepEngine(ex, Scheduler(SchedulerConfig(max_running=8, policy="chunked"),
                                                 BlockManager(256, 16, pool_hits=False)), overlap_masks=overlap)
                    reqs = [e.add_request(ServeRequest(f"r{i}", prompts[i % len(prompts)], max_tokens,
                                                       sampling=GREEDY, banned=ex.engine.eos_ids,
                                                       constraint=Constraint(tok, grammar) if schema else None))
                            for i in range(conc)]
                    waits = []
                    c0, t0 = time.process_time(), time.perf_counter()
                    while e.unfinished:
                        e.step()
                        waits.append(e.masks.wait_s)
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    e.masks.close()
                    n = sum(len(r.output) for r in reqs)
                    w = np.array(waits) * 1e3
                    out.append({"concurrency": conc, "mode": mode, "tokens": n, "steps": len(waits),
                                "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "tok_s": round(n / wall, 2),
                                "wait_p50_ms": _q(w, 50), "wait_p99_ms": _q(w, 99)})
                    print(out[-1], file=sys.stderr)
    return out


def draw_costs(threads: int, max_tokens: int = 128) -> list[dict]:
    """The grammar's part of each token in replies of the embedded model (llama.cpp, one request at a time) to the
    serve prompts with the serve schema: the draw tried without the mask first where the sampler may
    (``Sampler.draws_unmasked_first``), against the mask applied first (``apply``, as before); greedy and
    temperature 1 (no top-k/p, min-p); how many tokens needed a mask."""
    from localinfer.backends.executor import Chunk
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor
    from localinfer.generation.sampling import Sampler, SamplingParams
    from localinfer.model.sources import default_model_path

    out = []
    with LlamaCppExecutor.open(default_model_path(), n_slots=1, n_ctx=1024, threads=threads) as ex:
        eng = ex.engine
        tok, grammar = grammar_tokenizer(eng), grammar_from("json_schema", SERVE_SCHEMA, "schema")
        for temp in (0.0, 1.0):
            for first in ("draw", "mask"):
                times, masked = [], 0
                for i, topic in enumerate(TOPICS):
                    prompt = eng.tokenize(f"<|im_start|>user\nDescribe {topic} as JSON with title, year, genres and "
                                          "summary.<|im_end|>\n<|im_start|>assistant\n", special=True)
                    ex.drop(0)
                    c = Constraint(tok, grammar)
                    s = Sampler(SamplingParams(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=i), constraint=c)
                    logits, output = ex.step([Chunk(0, tuple(prompt), 0, True)])[0], []
                    for k in range(max_tokens):
                        t0 = time.perf_counter()
                        if first == "draw":
                            token = s.sample(logits, output)
                        else:
                            token = s._draw(c.apply(logits), output)
                            c.consume(token)
                        times.append(time.perf_counter() - t0)
                        masked += c._rows is not None and c._base == len(c.tokens) - 1
                        output.append(token)
                        if c.stopped_after(len(output)):
                            break
                        logits = ex.step([Chunk(0, (token,), len(prompt) + k, True)])[0]
                ms = np.array(times) * 1e3
                out.append({"temperature": temp, "first": first, "tokens": len(ms), "masks": int(masked),
                            "mean_ms": round(float(ms.mean()), 4), "p50_ms": _q(ms, 50), "p99_ms": _q(ms, 99)})
                print(out[-1], file=sys.stderr)
    return out


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"arch": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    ap.add_argument("--steps", type=int, default=300, help="mask steps per vocabulary and batch size")
    ap.add_argument("--serve", action="store_true", help="also measure serve tok/s with a schema and without")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16, help="--serve: requests per run (the same prompts each run)")
    ap.add_argument("--repeats", type=int, default=3, help="--serve: measurements of each server (median ratio)")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="--serve: also llama-server (scripts/build_llama_server.sh prints its path), the same runs")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engine", action="store_true", help="also measure the step engine in process, schema vs none")
    ap.add_argument("--no-mask", action="store_true", help="skip the mask cost measurement")
    ap.add_argument("--draws", action="store_true",
                    help="also measure the grammar's part of each token, drawn without the mask first or after it")
    ap.add_argument("--beside", action="store_true",
                    help="also measure the masks' share of the step with a real forward pass beside the fill")
    args = ap.parse_args(argv)
    from localinfer.backends.vocab import VocabOnly
    from localinfer.model.sources import default_model_path

    doc = {"machine": machine(), "python": platform.python_version(),
           "llguidance": __import__("llguidance").__version__, "mask": []}
    if not args.no_mask:
        base = VocabOnly(str(default_model_path()))
        vocabs = [("49k", lambda: base), ("152k", lambda: SyntheticVocab(base, lengths="merges")),
                  ("152k matched lengths", lambda: SyntheticVocab(base, lengths="matched")),
                  ("152k long pairs", lambda: SyntheticVocab(base, lengths="pairs"))]
        if qwen2 := qwen2_vocab_path():
            vocabs.append(("qwen2 152k", lambda: VocabOnly(qwen2)))
        t0, tok_build = time.perf_counter(), {}
        doc["mask_loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        for name, make in vocabs:
            vocab = make()
            t = time.perf_counter()
            grammar_tokenizer(vocab)
            tok_build[name] = round(time.perf_counter() - t, 3)
            doc.setdefault("over_10_bytes", {})[name] = long_share(vocab)
            for batch in (1, 8):
                doc["mask"].append({"name": name, **mask_costs(vocab, batch, args.steps)})
                print({k: v for k, v in doc["mask"][-1].items() if k != "slowest"}, file=sys.stderr)
        doc["mask_loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        if args.beside:
            doc["beside"] = []
            for name, make in vocabs:
                vocab = make()
                for batch in (1, 8):
                    doc["beside"].append({"name": name, **mask_beside_forward(vocab, batch, args.steps, args.threads)})
                    print(doc["beside"][-1], file=sys.stderr)
            doc["beside_loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        doc["tokenizer_build_s"] = tok_build
        doc["mask_seconds"] = round(time.perf_counter() - t0, 1)
    levels = [int(x) for x in args.levels.split(",")]
    if args.draws:
        doc["draws_loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        doc["draws"] = draw_costs(args.threads)
    if args.engine:
        doc["engine_loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        runs = doc["engine"] = engine_rates(levels, args.max_tokens, args.threads)
        doc["engine_loadavg_after"] = [round(x, 2) for x in os.getloadavg()]

        def per_token(c, mode, key):
            rs = [r for r in runs if r["concurrency"] == c and r["mode"] == mode]
            return sum(r[key] for r in rs) / sum(r["tokens"] for r in rs)

        doc["engine_ratio"] = {mode: {str(c): round(per_token(c, "none", "seconds") / per_token(c, mode, "seconds"), 3)
                                      for c in levels} for mode in MODES if mode != "none"}
        doc["engine_cpu_ms_per_token_added"] = {mode: {
            str(c): round(1e3 * (per_token(c, mode, "cpu_seconds") - per_token(c, "none", "cpu_seconds")), 3)
            for c in levels} for mode in MODES if mode != "none"}
    if args.serve:
        kinds = ["localinfer"] + (["llama-server"] if args.llama_server else [])
        doc["serve"] = {"threads": args.threads, "ctx": 8192, "parallel": 8, "requests": args.requests,
                        "max_tokens": args.max_tokens, "repeats": []}
        for rep in range(args.repeats):        # the servers one after the other, the first one rotated each time
            row = {}
            for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                with started(kind, args.llama_server, args.threads) as url:
                    before = [round(x, 2) for x in os.getloadavg()]
                    runs = serve_rates(url, levels, args.requests, args.max_tokens)
                    row[kind] = {"loadavg_before": before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                                 "runs": runs, "ratio": serve_ratios(runs, levels)}
                    print(kind, row[kind]["ratio"], row[kind]["loadavg_after"], file=sys.stderr)
            doc["serve"]["repeats"].append(row)
        doc["serve"]["median_ratio"] = {kind: {str(c): statistics.median(r[kind]["ratio"][str(c)]
                                                                          for r in doc["serve"]["repeats"])
                                               for c in levels} for kind in kinds}
    text = json.dumps(doc, indent=1)
    if args.out:
        atomic_write(args.out, text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
