"""Does `fit`'s resident figure hold on this CPU?  Load real GGUFs with llama.cpp and read the kernel's counts.

For each model and load mode a subprocess loads the model with llama.cpp
(llama-cpp-python's C API), creates a context, prefills one full micro-batch and
decodes a few tokens, and reads ``/proc/self/smaps_rollup`` and ``/proc/self/smaps``:

* anonymous bytes added by the load (the CPU_REPACK copy and, without mmap, the
  weights), then by the context and the tokens (KV, compute, output buffers);
* the resident pages of the model's file mapping after the run (what a process
  monitor shows: the whole mapped range, which llama.cpp maps with MAP_POPULATE);
* the mapping's working set: its pages are dropped from this process
  (``madvise(MADV_DONTNEED)``: clean file pages, refetched from the page cache on
  the next touch), a few more tokens are decoded, and the pages touched again are
  counted.  The kernel maps up to 16 neighbouring cached pages per fault
  (fault-around), so this is a slight overcount.

Measured resident = anonymous + working set; fit's prediction is
``MemoryBreakdown.resident_bytes``; the mapped total (``mapped_bytes``, llama.cpp's
buffers) and llama.cpp's own buffer report (``llama_get_memory_breakdown``) go beside.

    python benchmarks/fit_resident.py                      # Q4_0, Q4_K_M, Q2_K from one F16 model
    python benchmarks/fit_resident.py --json benchmarks/results/fit_resident_cpu.json
    python benchmarks/fit_resident.py --model my.gguf --ctx 2048
    python benchmarks/fit_resident.py --limits             # each mix under memory limits (a cgroup of its own)

``--limits`` runs the probe in a memory cgroup created for it (benchmarks/memlimit.py)
limited around fit's figures: resident ± a margin and the anonymous floor ± the margin
(see ``limit_rows``); the child measures its own baseline before loading.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")
MADV_DONTNEED = 4
_QUIET: list = []
OUTPUTS = 1             # logit rows per decode: the compute buffer is reserved for what the run then touches
MIXES = {"Q4_0 (pure)": ("LLAMA_FTYPE_MOSTLY_Q4_0", True), "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
         "Q2_K": ("LLAMA_FTYPE_MOSTLY_Q2_K", False)}
MODES = {"mmap": "LLAMA_LOAD_MODE_MMAP", "none": "LLAMA_LOAD_MODE_NONE", "mmap+mlock": "LLAMA_LOAD_MODE_MMAP_MLOCK"}


# ---- the kernel's counts ------------------------------------------------------------

def rollup() -> dict[str, int]:
    """/proc/self/smaps_rollup in bytes (Rss, Anonymous, Locked, ...)."""
    out = {}
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            p = line.split()
            if len(p) >= 3 and p[-1] == "kB":
                out[p[0].rstrip(":")] = int(p[1]) * 1024
    return out


def peak_rss() -> int:
    """VmHWM: the most this process has had resident so far, in bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def file_mappings(path: str) -> list[dict]:
    """This process's mappings of ``path``: address range and resident bytes (from /proc/self/smaps)."""
    real, res, cur = os.path.realpath(path), [], None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if not head[0].endswith(":") and "-" in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = {"lo": lo, "hi": hi, "rss": 0} if len(head) > 5 and head[5] == real else None
                if cur is not None:
                    res.append(cur)
            elif cur is not None and head[0] == "Rss:":
                cur["rss"] = int(head[1]) * 1024
    return res


# ---- the llama.cpp side (a subprocess per measurement) --------------------------------

def _probe_main(job: dict, progress=lambda stage: None) -> dict:
    import llama_cpp as L

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from localinfer.backends.llamacpp.dryrun_child import breakdown_reader

    cb = L.llama_log_callback(lambda level, text, user: None)
    L.llama_log_set(cb, None)
    L.llama_backend_init()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mp = L.llama_model_default_params()
    mp.load_mode = getattr(L, MODES[job["mode"]])
    mp.use_extra_bufts = job["repack"]
    before, before_hwm = rollup(), peak_rss()
    model = L.llama_model_load_from_file(job["path"].encode(), mp)
    if not model:
        return {"error": "load failed"}
    progress("loaded")
    loaded, hwm = rollup(), peak_rss()
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = job["n_ctx"], job["threads"], job["threads"]
    cp.n_outputs_max = OUTPUTS            # logits of the last token only, as a chat or a completion asks
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        return {"error": "context creation failed"}
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def decode(tokens: list[int]) -> None:
        arr = (L.llama_token * len(tokens))(*tokens)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")

    pos = job["prompt"]
    decode([(7 * i + 3) % n_vocab for i in range(pos)])       # a full micro-batch: the compute buffer's worst case
    for i in range(job["decode"]):
        decode([(11 * i + 5) % n_vocab])
    progress("decoded")
    ran = rollup()
    maps = file_mappings(job["path"])
    mapped_rss = working = sum(m["rss"] for m in maps)
    if "mlock" not in job["mode"]:              # locked pages cannot be dropped: they all stay
        for m in maps:
            if libc.madvise(m["lo"], m["hi"] - m["lo"], MADV_DONTNEED) != 0:
                return {"error": f"madvise failed: errno {ctypes.get_errno()}"}
        for i in range(job["decode"]):
            decode([(13 * i + 9) % n_vocab])
        working = sum(m["rss"] for m in file_mappings(job["path"]))
    buffers = breakdown_reader(L)(ctx)
    return {"anon_load": loaded["Anonymous"] - before["Anonymous"], "rss_load": loaded["Rss"] - before["Rss"],
            # VmHWM over the RSS before loading, less the file pages the load mapped (library code, the mapping)
            "peak_load": hwm - max(before["Rss"], before_hwm)
            - ((loaded["Rss"] - loaded["Anonymous"]) - (before["Rss"] - before["Anonymous"])),
            "locked": loaded.get("Locked", 0) - before.get("Locked", 0),
            "anon_run": ran["Anonymous"] - before["Anonymous"], "mapped_rss": mapped_rss, "working_set": working,
            "llama_buffers": buffers, "llama_total": sum(sum(v) for v in buffers.values())}


def measure(path: str, *, mode: str = "mmap", repack: bool = True, n_ctx: int = 1024, prompt: int = 512,
            decode: int = 4, threads: int = 2, timeout: float = 600) -> dict:
    """The kernel's counts for one load of ``path`` (see the module docstring), in a fresh subprocess."""
    job = {"path": str(path), "mode": mode, "repack": repack, "n_ctx": n_ctx, "prompt": min(prompt, n_ctx - 2 * decode),
           "decode": decode, "threads": threads}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", json.dumps(job)],
                          capture_output=True, text=True, timeout=timeout, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        return {"error": f"probe exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def predict(path: str, *, mode: str = "mmap", repack: bool = True, n_ctx: int = 512):
    """fit's breakdown for this machine with the probe's settings (flash attention on)."""
    from localinfer.backends.llamacpp.memory import breakdown
    from localinfer.backends.memory import FitRequest
    from localinfer.devices.profiles import local_device
    from localinfer.model.spec import ModelSpec

    req = FitRequest(n_ctx=n_ctx, flash_attn=True, mmap=mode != "none", mlock="mlock" in mode, repack=repack,
                     swa_full=True, n_outputs_max=OUTPUTS)
    return breakdown(ModelSpec.from_gguf(path), local_device(), req)[0]


# ---- under a memory limit (a cgroup of our own, benchmarks/memlimit.py) -------------------------

FIRST_LIMIT = 256 * MIB  # above the budget until the child has measured its own baseline


def _limited_main(job: dict) -> dict:
    """The probe in the cgroup ``job["memcg"]``, limited to the child's own baseline + ``job["budget"]``."""
    from benchmarks import memlimit

    cg = memlimit.Memcg(job["memcg"], job["memcg_version"])
    cg.enter(os.getpid())                   # first: what this process allocates from here on is charged there
    memlimit.drop_cache(job["path"])        # a cached page stays charged to whoever read it first
    import llama_cpp  # noqa: F401  (the libraries the probe loads belong to the baseline)

    from localinfer.backends.llamacpp.dryrun_child import breakdown_reader  # noqa: F401
    baseline = cg.usage()
    cg.set_limit(baseline + job["budget"])

    def progress(stage: str) -> None:
        refaults = cg.stat().get("workingset_refault_file", cg.stat().get("workingset_refault"))
        print(json.dumps({"stage": stage, f"refaults_{stage}": refaults}), flush=True)

    print(json.dumps({"stage": "limited", "baseline": baseline, "limit": cg.limit()}), flush=True)
    out = _probe_main(job, progress)
    return {**out, "peak": cg.peak(), "kernel": cg.kernel(), "stat": cg.stat()}


def measure_limited(path: str, budget: int, *, n_ctx: int = 1024, prompt: int = 512, decode: int = 4,
                    threads: int = 2, timeout: float = 300) -> dict:
    """The probe (see measure) in a new memory cgroup limited to the child's baseline + ``budget`` bytes.

    The child enters the cgroup first, evicts the model file from the page cache,
    imports llama.cpp, reads what it has been charged (``baseline``: the
    interpreter's imports), sets the limit, then loads, prefills and decodes.
    ``ok``: it decoded and exited cleanly; otherwise ``rc`` (-9: killed), ``oom_kills``
    and ``stages`` (limited, loaded, decoded: how far it got) say how it failed.
    Raises memlimit.Unavailable where no memory cgroup may be created.
    """
    from benchmarks import memlimit

    job = {"path": str(path), "mode": "mmap", "repack": True, "n_ctx": n_ctx,
           "prompt": min(prompt, n_ctx - 2 * decode), "decode": decode, "threads": threads, "budget": budget}
    with memlimit.child_memcg(budget + FIRST_LIMIT) as cg:
        job.update(memcg=str(cg.path), memcg_version=cg.version)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--limited", json.dumps(job)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            out, err = proc.communicate()
        oom_kills, cg_peak = cg.oom_kills(), cg.peak()
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    r = {"budget": budget, "rc": proc.returncode, "timed_out": timed_out, "oom_kills": oom_kills, "cg_peak": cg_peak,
         "stages": [x["stage"] for x in lines if "stage" in x]}
    for x in lines:
        r.update({k: v for k, v in x.items() if k != "stage"})
    r["ok"] = proc.returncode == 0 and "error" not in r and "decoded" in r["stages"]
    if not r["ok"]:
        r["stderr"] = err.strip()[-300:]
    return r


# ---- models -----------------------------------------------------------------------------

def quantize(src: str, dst: str, mix: str, threads: int = 2) -> str:
    """llama.cpp's own quantizer (llama_model_quantize), so the type of every tensor follows its mix rules."""
    import llama_cpp as L

    _QUIET.append(L.llama_log_callback(lambda level, text, user: None))   # kept alive: llama.cpp holds it
    L.llama_log_set(_QUIET[-1], None)
    ftype, pure = MIXES[mix]
    qp = L.llama_model_quantize_default_params()
    qp.nthread, qp.ftype, qp.pure = threads, getattr(L, ftype), pure
    if L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(qp)) != 0:
        raise RuntimeError(f"llama_model_quantize {mix} failed")
    return dst


def make_models(workdir: Path, *, n_layers: int = 8, n_embd: int = 1024, n_ff: int = 2816,
                vocab: int = 32000) -> dict[str, str]:
    """One random F16 llama model (byte-level vocabulary padded to ``vocab``), quantized to each mix."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from gguf import GGMLQuantizationType

    from tests.support.ggufgen import write_tiny_model

    src = workdir / f"base-{n_layers}x{n_embd}-f16.gguf"
    if not src.exists():
        write_tiny_model(src, n_layers=n_layers, n_embd=n_embd, n_head=n_embd // 128, n_head_kv=n_embd // 256,
                         n_ff=n_ff, qtype=GGMLQuantizationType.F16, n_extra_tokens=vocab - 259)
    out = {}
    for mix in MIXES:
        dst = workdir / f"{src.stem.replace('f16', mix.split()[0].lower())}.gguf"
        out[mix] = str(dst) if dst.exists() else quantize(str(src), str(dst), mix)
    return out


# ---- the comparison -----------------------------------------------------------------------

def row(name: str, path: str, mode: str, repack: bool, n_ctx: int) -> dict:
    bd = predict(path, mode=mode, repack=repack, n_ctx=n_ctx)
    m = measure(path, mode=mode, repack=repack, n_ctx=n_ctx)
    r = {"model": name, "file_bytes": os.path.getsize(path), "mode": mode, "repack": repack, "n_ctx": n_ctx,
         "fit_resident": bd.resident_bytes, "fit_mapped": bd.mapped_bytes, "fit_load_peak": bd.load_peak,
         "fit_repack": sum(t.bytes for t in bd.terms if t.buffer == "CPU_REPACK model"),
         **m}
    if "error" not in m:
        r["measured_resident"] = m["anon_run"] + m["working_set"]
        r["measured_rss"] = m["anon_run"] + m["mapped_rss"]
        r["d_resident"] = r["measured_resident"] - r["fit_resident"]
    return r


def render(rows: list[dict]) -> str:
    head = (f"{'model':<14}{'mode':<11}{'file':>8}{'fit res.':>10}{'measured':>10}{'Δ %':>7}"
            f"{'fit mapped':>11}{'RSS seen':>10}{'llama.cpp':>11}{'repack':>9}{'anon load':>11}"
            f"{'fit peak':>10}{'peak':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mode = r["mode"] + ("" if r["repack"] else " -nr")
        if r.get("error"):
            lines.append(f"{r['model']:<14}{mode:<11}  error: {r['error']}")
            continue
        lines.append(f"{r['model']:<14}{mode:<11}{r['file_bytes'] / MIB:>7.1f}M{r['fit_resident'] / MIB:>9.1f}M"
                     f"{r['measured_resident'] / MIB:>9.1f}M{100 * r['d_resident'] / r['fit_resident']:>6.1f}%"
                     f"{r['fit_mapped'] / MIB:>10.1f}M{r['measured_rss'] / MIB:>9.1f}M{r['llama_total'] / MIB:>10.1f}M"
                     f"{r['fit_repack'] / MIB:>8.1f}M{r['anon_load'] / MIB:>10.1f}M"
                     + (f"{r['fit_load_peak'] / MIB:>9.1f}M{r['peak_load'] / MIB:>7.1f}M" if r["fit_load_peak"] else ""))
    lines.append("\nmeasured = anonymous bytes after a full micro-batch + the model mapping's working set "
                 "(pages touched again after MADV_DONTNEED); RSS seen = anonymous + the mapping before that; "
                 "llama.cpp = its buffer report (model + KV + compute), the mapped range whole; peak (no mmap) = "
                 "anonymous high-water mark while loading (VmHWM less file pages)")
    return "\n".join(lines)


def floor_bytes(bd) -> int:
    """fit's resident figure less the mapped bytes read after load: the anonymous part, which no reclaim can take."""
    return bd.resident_bytes - sum(t.resident or 0 for t in bd.terms if t.buffer == "CPU_Mapped model")


def limit_rows(name: str, path: str, n_ctx: int, *, slack: int = 8 * MIB, timeout: float = 90) -> list[dict]:
    """Runs under memory limits around fit's figures: mapped + margin, resident ± margin, the anonymous floor ± margin.

    margin = llama.cpp's bookkeeping outside its buffers (measured: the anonymous
    bytes a load adds with repacking off) + ``slack``.
    """
    bd = predict(path, n_ctx=n_ctx)
    bookkeeping = measure(path, repack=False, n_ctx=n_ctx)["anon_load"]
    margin, floor = bookkeeping + slack, floor_bytes(bd)
    points = {"mapped + margin": bd.mapped_bytes + margin, "resident + margin": bd.resident_bytes + margin, "resident - margin": bd.resident_bytes - margin,
              "floor + margin": floor + margin, "floor - margin": floor - margin}
    rows, done = [], []
    for label, budget in points.items():
        if any(abs(budget - b) < MIB for b in done):
            continue
        done.append(budget)
        t0 = time.monotonic()
        r = measure_limited(path, budget, n_ctx=n_ctx, timeout=timeout)
        seconds = time.monotonic() - t0
        run_refaults = (r.get("refaults_decoded") or 0) - (r.get("refaults_loaded") or 0) if r["ok"] else None
        last = r["stages"][-1] if r["stages"] else "start"
        how = ("decoded" if r["ok"] else f"timed out after {last}" if r["timed_out"]
               else f"{'OOM-killed' if r['oom_kills'] else r.get('error', 'rc ' + str(r['rc']))} after {last}")
        rows.append({"model": name, "file_bytes": os.path.getsize(path), "n_ctx": n_ctx, "fit_resident": bd.resident_bytes,
                     "fit_floor": floor, "fit_mapped": bd.mapped_bytes, "bookkeeping": bookkeeping, "margin": margin,
                     "limit": label, "budget": budget, "ok": r["ok"], "result": how, "seconds": seconds,
                     "baseline": r.get("baseline"), "reread_bytes": None if run_refaults is None else run_refaults * PAGE,
                     "mapped_rss": r.get("mapped_rss") if r["ok"] else None, "anon_run": r.get("anon_run")})
    return rows


def _mib(v: int | None) -> str:
    return f"{v / MIB:>8.1f}M" if v is not None else f"{'-':>9}"


def render_limits(rows: list[dict]) -> str:
    head = (f"{'model':<14}{'file':>8}{'fit res.':>10}{'floor':>9}{'mapped':>9}{'margin':>8}  {'limit':<19}"
            f"{'budget':>9}  {'result':<22}{'time':>6}{'re-read':>9}{'map RSS':>9}{'baseline':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['file_bytes'] / MIB:>7.1f}M{r['fit_resident'] / MIB:>9.1f}M"
                     f"{r['fit_floor'] / MIB:>8.1f}M{r['fit_mapped'] / MIB:>8.1f}M{r['margin'] / MIB:>7.1f}M  "
                     f"{r['limit']:<19}{r['budget'] / MIB:>8.1f}M  {r['result']:<22}{r['seconds']:>5.1f}s"
                     f"{_mib(r['reread_bytes'])}{_mib(r['mapped_rss'])} {_mib(r['baseline'])}")
    lines.append("\nbudget = cgroup limit less the child's baseline (interpreter + llama.cpp's libraries, measured in "
                 "the child before loading); floor = fit resident less the mapped bytes read after load (anonymous: no "
                 "reclaim takes it); margin = llama.cpp's bookkeeping outside its buffers (anonymous bytes a load adds "
                 "with repacking off) + 8 MiB; re-read = file pages refaulted from the context's creation to the last "
                 "decode (prefill + decodes); map RSS = the model mapping's resident pages after the run")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="GGUF file(s) to measure instead of the generated mixes")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--modes", default="mmap,none", help="load modes, comma-separated (mmap, none, mmap+mlock)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--limits", action="store_true",
                    help="instead: run each model in a memory cgroup of its own, limited around fit's figures")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--limited", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(_probe_main(json.loads(args.probe))), flush=True)
        return 0
    if args.limited:
        print(json.dumps(_limited_main(json.loads(args.limited))), flush=True)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fit-resident-"))
    workdir.mkdir(parents=True, exist_ok=True)
    models = {Path(m).name: m for m in args.model} if args.model else make_models(workdir)
    if args.limits:
        rows = [r for name, path in models.items() for r in limit_rows(name, path, args.ctx)]
        print(render_limits(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    rows = [row(name, path, mode, True, args.ctx) for name, path in models.items() for mode in args.modes.split(",")]
    rows += [row(name, path, "mmap", False, args.ctx) for name, path in models.items()]
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
