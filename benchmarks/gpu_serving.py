"""The torch serving path on a GPU: the paged executor behind the step engine, on an 8B-shaped model.

One script for a lent GPU (H200: torch + transformers + triton, no ``gguf``, no internet), done in under
ten minutes, everything under ``$OUT`` (default ./out): ``gpu_serving.json`` (every number; a section that
failed holds its error and the rest go on, one the time guard skipped says so) and ``gpu_serving.txt``
(the tables as printed).  ``--smoke`` runs every section on the CPU with a 2-layer model (same JSON keys).

    python3 -m pip download --no-deps -d .whl gguf        # here, once (.whl/ is git-ignored)
    device run, carry [".whl"]:  PYTHONUNBUFFERED=1 python3 benchmarks/gpu_serving.py
    python benchmarks/gpu_serving.py --smoke              # CPU, tiny model, < 1 minute

The model.  Qwen3-8B dimensions (36 layers, 4096 embd, 32 heads, 8 KV heads, head dim 128, FFN 12288,
vocab 151936) in bf16 with random weights generated on the spot, on the device, by
``gpu_torch.random_weights`` (std 0.02, seed 0): GGUF-named tensors in torch order, which is what
``cuda_backend.weights.load_weights`` returns for a file, handed to the same ``Transformer`` and
``PagedExecutor`` (block size ``serving.BLOCK_TOKENS``, block tables from the engine's block manager,
CUDA graphs) that ``serving.open_executor`` builds after reading a file.  No .gguf file is written: the
weights are made as tensors because a 16 GB bf16 file written and read back would cost minutes of the
ten and 16 GB of the machine's 64 GB disk, and would measure nothing reported here.  localinfer still
imports gguf's constants (through gguf_tools), so the pure-Python gguf wheel (118 kB) travels with the
checkout and is unpacked at start (``gpu_torch.ensure_gguf``).  The KV pool is bf16.

Sections (``$OUT/gpu_serving.json`` keys):

* ``decode``: step time at batch 1 / 4 / 16 / 64 with 2048 tokens of context per request, through
  ``PagedExecutor.step`` (what the engine calls: chunk checks, slot mapping, the graph replay, logits of
  every row copied to the host), CUDA graphs on.  ``forward_s`` is the replay alone.  MBU = bytes a step
  must read / time / β, bytes = D_w + b·L·k; roofline = max(b·F/P, (D_w + b·L·k)/β) (docs/speed.md),
  β and P from the device profile (``localinfer/devices/profiles.py``).  The context is restored
  (``executor.restore``) into blocks the block manager allocated, not prefilled: its KV is zeros, which
  costs the same to read.
* ``throughput_vs_batch``: tokens/s against batch (graphs on, and off from ``decode_eager``), beside the
  chapter's vLLM steps on the RTX PRO 6000 (26.26 / 26.62 / 27.44 / 29.63 ms at batch 1 / 4 / 16 / 64, 2K
  context, CUDA graphs off).
* ``shared_prefix``: the chapter's 16 requests × 8192 prompt tokens sharing a 6144-token prefix through
  the step engine (scheduler + block manager, prefix cache reading blocks from the pool): the first request
  is prefilled alone, then the other 15 find its 384 prefix blocks; prefill seconds (all 16 first tokens),
  ms per decode step of the 16, blocks used against the blocks without sharing.
  ``shared_prefix_no_sharing`` is the same with the prefix cache off, measured when time is left.
* ``transformers``: Hugging Face transformers' Qwen3 with a static cache on the same weight tensors in the
  same process (the decode loop that ``generate(cache_implementation="static")`` runs per token:
  ``gpu_torch.hf_decode``, torch.compile "reduce-overhead" when time allows, else eager) at batch 1 and
  16, the same context, and the ratio of our tokens/s to theirs; skipped with a note without transformers.
* ``decode_eager``: ``decode`` with CUDA graphs off (the chapter's setting); ``decode_alt_attention``: the
  graphs recaptured with the model's other attention (grouped matmuls instead of SDPA on CUDA).
* ``targets`` (reported, not asserted): batch-1 decode MBU ≥ 70% with CUDA graphs, batch-64 step ≤ 1.25×
  the roofline, ≥ 1.3× transformers' tokens/s at batch 1 and 16.

A time guard skips the remaining sections once 9.5 minutes (``--budget``) have passed or a section's
estimate no longer fits; the JSON is rewritten after every section.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()       # the time guard counts from here, imports included

import argparse
import json
import os
import platform
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    from benchmarks.gpu_torch import (
        GGUF_WHEEL,
        QWEN3_8B,
        TINY,
        device_profile,
        figures,
        hf_agreement,
        hf_decode,
        hf_model,
        make_config,
        random_weights,
        sync,
    )
except SystemExit as exc:     # no gguf and no wheel: say so in $OUT too
    _out = Path(os.environ.get("OUT") or "out")
    _out.mkdir(parents=True, exist_ok=True)
    (_out / "gpu_serving.json").write_text(json.dumps({"script": "benchmarks/gpu_serving.py", "error": str(exc)}) + "\n")
    raise

import numpy as np
import torch

from cuda_backend.memory import graph_batches
from cuda_backend.model import Transformer
from cuda_backend.paged_executor import PagedExecutor
from cuda_backend.paged_graphs import PagedGraphs
from cuda_backend.serving import BLOCK_TOKENS
from localinfer.backends.executor import Chunk
from localinfer.plan.paging import blocks_for
from localinfer.serve.assembly import build_step_engine
from localinfer.serve.block_manager import BlockManager
from localinfer.serve.request import Request
from localinfer.serve.scheduler import SchedulerConfig

CHAPTER_MS = {1: 26.26, 4: 26.62, 16: 27.44, 64: 29.63}   # vLLM, RTX PRO 6000, Qwen3-8B bf16, 2K, graphs off
TARGETS = {"batch1_mbu": 0.70, "batch64_x_roofline": 1.25, "ours_over_transformers": 1.3}
SECTIONS = ("setup", "decode", "shared_prefix", "transformers", "shared_prefix_no_sharing", "decode_eager",
            "decode_alt_attention", "throughput_vs_batch", "targets")


class Sizes:
    """What each section runs: the real sizes, or the smoke run's."""

    def __init__(self, smoke: bool):
        self.dims = TINY if smoke else QWEN3_8B
        self.batches = (1, 4, 16, 64)
        self.ctx = 64 if smoke else 2048                  # decode context per request
        self.warm, self.steps = (1, 4) if smoke else (3, 32)
        self.n_req = 16
        self.prompt, self.prefix = (256, 192) if smoke else (8192, 6144)
        self.out_tokens = 9 if smoke else 33               # per request of the shared-prefix case
        self.hf_batches = (1, 16)
        # memory.graph_batches stops at 32 (CUDA_GRAPH_BATCHES); batch 64 gets its own graph here
        self.graph_batches = tuple(sorted(set(graph_batches(max(self.batches))) | {max(self.batches)}))
        self.max_len = self.prompt + self.out_tokens + BLOCK_TOKENS
        per_decode = blocks_for(self.ctx + self.warm + self.steps, BLOCK_TOKENS)
        unshared = self.n_req * blocks_for(self.prompt + self.out_tokens - 1, BLOCK_TOKENS)
        self.num_blocks = max(max(self.batches) * per_decode, unshared) + 8
        # rough seconds per section on an H200 (the time guard skips a section that would not fit)
        self.need = {} if smoke else {"decode": 30, "shared_prefix": 45, "transformers": 60,
                                      "shared_prefix_no_sharing": 45, "decode_eager": 30, "decode_alt_attention": 45}


class Run:
    """Sections in order, each in try/except, the JSON and the text rewritten after each one."""

    def __init__(self, out: Path, budget_s: float, smoke: bool):
        self.out, self.budget_s, self.t0 = out, budget_s, T_START
        out.mkdir(parents=True, exist_ok=True)
        self.result: dict = {"script": "benchmarks/gpu_serving.py", "smoke": smoke, "budget_s": budget_s}
        self.lines: list[str] = []
        self.state: dict = {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def section(self, name: str, fn, need_s: float = 0.0) -> None:
        if self.left() < need_s:
            self.result[name] = {"skipped": f"time guard: {self.left():.0f} s left of {self.budget_s:.0f}, "
                                            f"the section needs about {need_s:.0f} s"}
            self.say(f"[{name}] skipped ({self.result[name]['skipped']})")
            self.save()
            return
        t0 = time.perf_counter()
        try:
            value = fn()
            value["seconds"] = round(time.perf_counter() - t0, 3)
            self.result[name] = value
        except Exception as exc:  # noqa: BLE001 - one failure must not lose the other sections
            self.result[name] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc(limit=12)}
            self.say(f"[{name}] failed after {time.perf_counter() - t0:.1f} s: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.save()

    def save(self) -> None:
        self.result["wall_s"] = round(time.perf_counter() - self.t0, 3)
        for name, data in (("gpu_serving.json", json.dumps(self.result, indent=2) + "\n"),
                           ("gpu_serving.txt", "\n".join(self.lines) + "\n")):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(data)
            os.replace(tmp, self.out / name)


def need(state: dict, key: str):
    if key not in state:
        raise RuntimeError(f"needs {key!r}, which an earlier section did not make")
    return state[key]


# ---- sections ---------------------------------------------------------------------------------------------
def setup(run: Run, sz: Sizes, device: torch.device, profile: str) -> dict:
    prof = device_profile(profile)
    cfg = make_config(sz.dims)
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    weights = random_weights(cfg, device, dtype)
    sync(device)
    t_weights = time.perf_counter() - t0
    model = Transformer(cfg, weights, sz.max_len, dtype)
    t0 = time.perf_counter()
    ex = PagedExecutor(model, n_slots=max(sz.batches), num_blocks=sz.num_blocks, block_size=BLOCK_TOKENS,
                       type_k="bf16", type_v="bf16", max_model_len=sz.max_len, external_blocks=True,
                       cuda_graphs=device.type == "cuda", padded_decode=device.type != "cuda",
                       graph_batches=sz.graph_batches)
    sync(device)
    t_exec = time.perf_counter() - t0
    fig = figures(cfg, weights)
    run.state.update(prof=prof, cfg=cfg, weights=weights, model=model, ex=ex, fig=fig, device=device)
    g = ex.graphs
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
           "profile": prof.name, "bandwidth_bytes_per_s": prof.bandwidth_bytes_per_s, "bf16_flops": prof.bf16_flops,
           "model": "qwen3-8b-shape" if sz.dims is QWEN3_8B else "tiny", "dims": sz.dims, **fig,
           "weights_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
           "weights_s": round(t_weights, 3), "executor_s": round(t_exec, 3), "block_tokens": BLOCK_TOKENS,
           "num_blocks": ex.pool.num_blocks, "pool_bytes": ex.pool.nbytes, "max_model_len": sz.max_len,
           "graphs": len(g.graphs) if g else 0, "graph_batches": list(g.batches) if g else [],
           "graph_widths": list(g.widths) if g else [], "graph_bytes": g.measured_bytes if g else 0,
           "decode_path": "cuda graphs" if g and g.graphs else ("padded (eager)" if g else "varlen"),
           "torch": torch.__version__, "gguf_wheel": GGUF_WHEEL and os.path.basename(GGUF_WHEEL)}
    run.say(f"{out['device']}: D_w {fig['D_w'] / 1e9:.2f} GB, F {fig['F'] / 1e9:.1f} GFLOP/token, k {fig['k']} B/token; "
            f"profile {prof.name}: {prof.bandwidth_bytes_per_s / 1e12:.2f} TB/s, {prof.bf16_flops / 1e12:.0f} TFLOP/s")
    run.say(f"weights {t_weights:.1f} s; executor {t_exec:.1f} s ({out['graphs']} graphs, "
            f"{out['graph_bytes'] / 2**20:.0f} MiB; pool {ex.pool.num_blocks} blocks, {ex.pool.nbytes / 2**30:.2f} GiB)")
    return out


def roofline(fig: dict, prof, b: int, L: float) -> tuple[float, float]:
    """(bytes a decode step reads, roofline seconds) at batch b and context L."""
    read = fig["D_w"] + b * L * fig["k"]
    return read, max(b * fig["F"] / prof.bf16_flops, read / prof.bandwidth_bytes_per_s)


def decode(run: Run, sz: Sizes, batches=None, label: str = "graphs") -> dict:
    """Decode steps at each batch: every slot restored to ctx tokens in blocks from a block manager."""
    ex, fig, prof = need(run.state, "ex"), run.state["fig"], run.state["prof"]
    bm = BlockManager(ex.pool.num_blocks, ex.block_size, prefix_cache=False)
    rows = []
    run.say(f"decode ({label}), context {sz.ctx}: {'batch':>5}{'step ms':>10}{'fwd ms':>9}{'tok/s':>10}{'MBU':>7}"
            f"{'fwd MBU':>9}{'roof ms':>10}{'x roof':>10}")
    for b in batches or sz.batches:
        seqs = [("decode", s) for s in range(b)]
        for s, seq in enumerate(seqs):
            bm.allocate(seq, [0] * sz.ctx, reserve_tokens=sz.ctx + sz.warm + sz.steps)
            ex.restore(s, sz.ctx)
        tables = [tuple(bm.tables[seq]) for seq in seqs]
        try:
            def one(i, b=b, tables=tables):
                return ex.step([Chunk(s, (1,), sz.ctx + i, True, blocks=tables[s]) for s in range(b)])

            for i in range(sz.warm):
                one(i)
            sync(ex.device)
            f0, t0 = ex.forward_seconds, time.perf_counter()
            for i in range(sz.warm, sz.warm + sz.steps):
                one(i)
            sync(ex.device)
            wall = (time.perf_counter() - t0) / sz.steps
            fwd = (ex.forward_seconds - f0) / sz.steps
        finally:
            for s, seq in enumerate(seqs):
                ex.drop(s)
                bm.free(seq)
        L = sz.ctx + sz.warm + sz.steps / 2            # mean context over the timed steps
        read, roof = roofline(fig, prof, b, L)
        beta = prof.bandwidth_bytes_per_s
        row = {"batch": b, "ctx": sz.ctx, "step_s": wall, "forward_s": fwd, "tok_s": b / wall,
               "mbu": read / wall / beta, "forward_mbu": read / fwd / beta if fwd else None,
               "roofline_s": roof, "x_roofline": wall / roof, "bytes_read": read}
        rows.append(row)
        run.say(f"{'':>36}{b:5}{wall * 1e3:10.2f}{fwd * 1e3:9.2f}{b / wall:10.1f}{row['mbu']:7.0%}"
                f"{row['forward_mbu'] or 0:9.0%}{roof * 1e3:10.3f}{wall / roof:10.2f}")
    return {"path": label, "rows": rows}


def throughput(run: Run) -> dict:
    rows = need(run.result.get("decode", {}), "rows")
    eager = {r["batch"]: r for r in run.result.get("decode_eager", {}).get("rows", [])}
    out = []
    run.say(f"throughput vs batch: {'batch':>5}{'ours ms':>9}{'ours tok/s':>12}{'eager ms':>10}{'chapter ms':>12}"
            f"{'chapter tok/s':>15}")
    for r in rows:
        b, ref = r["batch"], CHAPTER_MS.get(r["batch"])
        row = {"batch": b, "step_ms": r["step_s"] * 1e3, "tok_s": r["tok_s"],
               "eager_step_ms": eager[b]["step_s"] * 1e3 if b in eager else None, "chapter_step_ms": ref,
               "chapter_tok_s": b / ref * 1e3 if ref else None}
        out.append(row)
        run.say(f"{'':>21}{b:5}{row['step_ms']:9.2f}{row['tok_s']:12.1f}{row['eager_step_ms'] or float('nan'):10.2f}"
                f"{ref or float('nan'):12.2f}{row['chapter_tok_s'] or float('nan'):15.1f}")
    return {"rows": out, "chapter": "vLLM on the RTX PRO 6000, Qwen3-8B bf16, 2K context, CUDA graphs off"}


def shared_prefix(run: Run, sz: Sizes, sharing: bool = True) -> dict:
    """16 requests × prompt tokens, the first prefix tokens shared; the first request prefilled alone first."""
    ex, cfg = need(run.state, "ex"), run.state["cfg"]
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(1, cfg.vocab_size, sz.prefix)]
    prompts = [tuple(prefix + [int(t) for t in rng.integers(1, cfg.vocab_size, sz.prompt - sz.prefix)])
               for _ in range(sz.n_req)]
    e = build_step_engine(ex, SchedulerConfig(max_running=sz.n_req, admission="reserve"),
                          num_blocks=ex.pool.num_blocks, prefix_cache=sharing)
    tokens0, fwd0 = ex.tokens_computed, ex.forward_seconds
    sync(ex.device)
    t0 = time.perf_counter()
    first = e.add_request(Request("p0", prompts[0], sz.out_tokens))
    while not first.output:
        e.step()
    t_first = time.perf_counter() - t0
    rest = [e.add_request(Request(f"p{i}", p, sz.out_tokens)) for i, p in enumerate(prompts[1:], 1)]
    while any(not r.output for r in rest):
        e.step()
    prefill = time.perf_counter() - t0
    prefill_tokens = ex.tokens_computed - tokens0
    steps = []
    while e.unfinished:
        t = time.perf_counter()
        n = len(e.scheduler.running)
        e.step()
        if n == sz.n_req:
            steps.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    reqs = [first] + rest
    unshared = sz.n_req * blocks_for(sz.prompt + sz.out_tokens - 1, BLOCK_TOKENS)
    out = {"requests": sz.n_req, "prompt_tokens": sz.prompt, "prefix_tokens": sz.prefix, "sharing": sharing,
           "out_tokens": sz.out_tokens, "prefill_s": prefill, "first_request_prefill_s": t_first,
           "prefill_tokens_computed": prefill_tokens, "decode_steps": len(steps),
           "decode_step_ms": float(np.median(steps)) * 1e3 if steps else None,
           "decode_step_ms_mean": float(np.mean(steps)) * 1e3 if steps else None,
           "total_s": total, "forward_s": ex.forward_seconds - fwd0,
           "cached_tokens": sorted({r.cached for r in reqs}), "blocks_peak": e.blocks.peak_used,
           "blocks_without_sharing": unshared, "block_ratio": e.blocks.peak_used / unshared,
           "outputs": [list(r.output) for r in reqs[:2]], "all_finished": all(r.finished for r in reqs)}
    run.state["outputs_" + ("shared" if sharing else "unshared")] = [list(r.output) for r in reqs]
    if not sharing and "outputs_shared" in run.state:
        same = [a == b for a, b in zip(run.state["outputs_shared"], run.state["outputs_unshared"])]
        out["outputs_equal_to_shared"] = f"{sum(same)}/{len(same)}"
    run.say(f"shared prefix ({'on' if sharing else 'off'}): {sz.n_req} x {sz.prompt} tokens, {sz.prefix} shared: "
            f"prefill {prefill:.2f} s ({prefill_tokens} tokens computed; the first request {t_first:.2f} s), "
            f"decode {out['decode_step_ms'] or float('nan'):.2f} ms/step ({len(steps)} steps of {sz.n_req}), "
            f"blocks {e.blocks.peak_used} vs {unshared} unshared ({out['block_ratio']:.2f}x)")
    return out


def transformers_section(run: Run, sz: Sizes, allow_compile: bool) -> dict:
    try:
        import transformers
    except ImportError as exc:
        return {"skipped": f"transformers is not installed ({exc})"}
    model, cfg, weights, device = need(run.state, "model"), run.state["cfg"], run.state["weights"], run.state["device"]
    hf, hc = hf_model(cfg, weights, device, torch.bfloat16)
    out = {"transformers": transformers.__version__, "batches": list(sz.hf_batches), "ctx": sz.ctx,
           "rel_logit_diff": hf_agreement(model, cfg, hf, device)}
    compiled = allow_compile and device.type == "cuda" and run.left() > 300
    out["compile"] = "reduce-overhead" if compiled else "off"
    if allow_compile and not compiled:
        out["compile_note"] = "eager: compiling needs ~5 minutes" if device.type == "cuda" else "eager on the CPU"
    try:
        steps = hf_decode(hf, hc, device, sz.hf_batches, sz.ctx, sz.steps, compiled)
    except Exception as exc:
        if not compiled:
            raise
        out["compile"], out["compile_error"] = "off", f"{type(exc).__name__}: {exc}"
        steps = hf_decode(hf, hc, device, sz.hf_batches, sz.ctx, sz.steps, False)
    ours = {r["batch"]: r for r in run.result.get("decode", {}).get("rows", [])}
    fig, prof = run.state["fig"], run.state["prof"]
    rows = []
    run.say(f"transformers {transformers.__version__} static cache ({out['compile']}), same weights "
            f"(logits differ by {out['rel_logit_diff']:.1e} of the largest): {'batch':>5}{'HF ms':>9}{'HF tok/s':>10}"
            f"{'HF MBU':>8}{'ours/HF':>9}")
    for b, t in steps.items():
        read, _ = roofline(fig, prof, b, sz.ctx + 3 + sz.steps / 2)
        row = {"batch": b, "step_s": t, "tok_s": b / t, "mbu": read / t / prof.bandwidth_bytes_per_s}
        if b in ours:     # ours: a serving step (synchronised, logits to the host); theirs: pipelined forwards
            row["ours_over_hf"] = t / ours[b]["step_s"]
            row["ours_forward_over_hf"] = t / ours[b]["forward_s"] if ours[b]["forward_s"] else None
        rows.append(row)
        run.say(f"{'':>60}{b:5}{t * 1e3:9.2f}{b / t:10.1f}{row['mbu']:8.0%}{row.get('ours_over_hf', float('nan')):9.2f}")
    out["rows"] = rows
    del hf
    return out


def decode_eager(run: Run, sz: Sizes) -> dict:
    ex = need(run.state, "ex")
    graphs, ex.graphs = ex.graphs, None
    try:
        return decode(run, sz, label="eager (varlen, no graphs)")
    finally:
        ex.graphs = graphs


def decode_alt_attention(run: Run, sz: Sizes) -> dict:
    """The decode graphs recaptured with the model's other attention: grouped matmuls (``_attend``, what the
    CPU uses) where the default is SDPA, and SDPA on the CPU."""
    ex, model = need(run.state, "ex"), run.state["model"]
    before = model.manual_attention
    ex.graphs = None
    if ex.device.type == "cuda":
        torch.cuda.empty_cache()
    model.manual_attention = not before
    try:
        ex.graphs = PagedGraphs(model, ex.pool, ex.max_blocks, sz.graph_batches)
        out = decode(run, sz, batches=(1, 16, 64), label="grouped matmuls" if not before else "sdpa")
    finally:
        model.manual_attention = before
    out["attention"] = "grouped matmuls" if not before else "sdpa"
    return out


def targets(run: Run) -> dict:
    """The issue's GPU targets, reported (not asserted)."""
    rows = {r["batch"]: r for r in run.result.get("decode", {}).get("rows", [])}
    hf = {r["batch"]: r for r in run.result.get("transformers", {}).get("rows", [])}
    out = {}

    def put(key, value, goal, ok):
        out[key] = {"value": value, "target": goal, "met": None if value is None else ok(value)}

    put("batch1_decode_mbu", rows.get(1, {}).get("mbu"), TARGETS["batch1_mbu"], lambda v: v >= TARGETS["batch1_mbu"])
    put("batch1_forward_mbu", rows.get(1, {}).get("forward_mbu"), TARGETS["batch1_mbu"],
        lambda v: v >= TARGETS["batch1_mbu"])
    fwd64 = rows.get(64, {})
    put("batch64_x_roofline", fwd64.get("x_roofline"), TARGETS["batch64_x_roofline"],
        lambda v: v <= TARGETS["batch64_x_roofline"])
    put("batch64_forward_x_roofline", fwd64["forward_s"] / fwd64["roofline_s"] if fwd64.get("forward_s") else None,
        TARGETS["batch64_x_roofline"], lambda v: v <= TARGETS["batch64_x_roofline"])
    for b in (1, 16):
        for key, col in (("ours_over_transformers", "ours_over_hf"), ("ours_forward_over_transformers",
                                                                      "ours_forward_over_hf")):
            put(f"{key}_b{b}", hf.get(b, {}).get(col), TARGETS["ours_over_transformers"],
                lambda v: v >= TARGETS["ours_over_transformers"])
    out["note"] = ("step: PagedExecutor.step as the engine calls it (host work, graph replay, synchronise, every "
                   "row's logits copied to the host); forward: the replay alone")
    for k, v in out.items():
        if k == "note":
            continue
        val = "-" if v["value"] is None else f"{v['value']:.3f}"
        run.say(f"target {k}: {val} (target {v['target']}): {'-' if v['met'] is None else ('met' if v['met'] else 'missed')}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="every section on the CPU with a 2-layer model")
    ap.add_argument("--profile", default="h200", help="device profile for MBU and the roofline")
    ap.add_argument("--budget", type=float, default=None, help="seconds before remaining sections are skipped "
                                                              "(default 570; --smoke 110)")
    ap.add_argument("--no-hf-compile", action="store_true", help="transformers eager (no torch.compile)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./out)")
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "out")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: running the smoke sizes on the CPU", file=sys.stderr)
        args.smoke = True
    if device.type == "cpu":
        torch.manual_seed(0)
    sz = Sizes(args.smoke)
    run = Run(out, args.budget if args.budget is not None else (110.0 if args.smoke else 570.0), args.smoke)
    run.section("setup", lambda: setup(run, sz, device, args.profile))
    run.section("decode", lambda: decode(run, sz), sz.need.get("decode", 0))
    run.section("shared_prefix", lambda: shared_prefix(run, sz), sz.need.get("shared_prefix", 0))
    run.section("transformers", lambda: transformers_section(run, sz, not args.no_hf_compile and not args.smoke),
                sz.need.get("transformers", 0))
    run.section("shared_prefix_no_sharing", lambda: shared_prefix(run, sz, sharing=False),
                sz.need.get("shared_prefix_no_sharing", 0))
    run.section("decode_eager", lambda: decode_eager(run, sz), sz.need.get("decode_eager", 0))
    run.section("decode_alt_attention", lambda: decode_alt_attention(run, sz), sz.need.get("decode_alt_attention", 0))
    run.section("throughput_vs_batch", lambda: throughput(run))
    run.section("targets", lambda: targets(run))
    failed = [k for k in SECTIONS if isinstance(run.result.get(k), dict) and "error" in run.result[k]]
    run.result["failed_sections"] = failed
    run.say(f"done in {time.perf_counter() - run.t0:.1f} s; results in {out / 'gpu_serving.json'}"
            + (f"; failed: {', '.join(failed)}" if failed else ""))
    run.save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
