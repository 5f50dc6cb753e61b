"""Loopback llama.cpp RPC workers for tests and benchmarks, and llama.cpp's exact per-device buffer report.

``workers(n)`` starts ``n`` workers (``localinfer worker --port 0``'s child, 1 thread each) on ephemeral
loopback ports and stops them on exit; ``reported(model, endpoints, ...)`` loads the model across them in a
subprocess (an abort there cannot take the caller down) and returns llama.cpp's own byte counts per buffer
type (``llama_get_memory_breakdown``: model, context (KV), compute), keyed by buffer name such as
``RPC0[127.0.0.1:40123]``, plus the buffer lines of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def start_worker(threads: int = 1, mem: int | None = None) -> tuple[subprocess.Popen, str]:
    from localinfer.backends.llamacpp.rpc_probe import listening
    from localinfer.commands.worker import reserve_port

    port = reserve_port("127.0.0.1", 0)
    ep = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "localinfer.backends.llamacpp.rpc", ep, str(threads), "-",
                             *([str(mem)] if mem else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if listening(ep, timeout=0.5):
            return proc, ep
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"worker {ep} did not start")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def workers(n: int, threads: int = 1, mem=None):
    """``n`` loopback workers (``mem``: bytes each one reports, a list): yields [(process, endpoint)], all
    stopped on exit."""
    started = []
    try:
        for i in range(n):
            started.append(start_worker(threads, mem[i] if mem else None))
        yield started
    finally:
        for proc, _ in started:
            stop(proc)


def _probe_main(payload: str) -> None:
    sys.path.insert(0, str(ROOT))
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.llamacpp import native
    from localinfer.backends.llamacpp.dryrun_child import breakdown_reader

    job = json.loads(payload)
    native.init_backend()
    import llama_cpp as L

    read_breakdown = breakdown_reader(L)
    for case in job["cases"]:
        native.log_lines.clear()
        opts = {"rpc": job["endpoints"]}
        if case.get("tensor_split"):
            opts["tensor_split"] = case["tensor_split"]
        opts.update({k: case[k] for k in ("override_tensor", "cpu_moe", "n_cpu_moe", "mmap", "repack") if k in case})
        plan = LoadPlan(job["model"], n_ctx=case["n_ctx"], n_seq=case.get("n_seq", 1), n_threads=1,
                        n_batch=case.get("n_batch", 512), n_ubatch=case.get("n_ubatch", 512),
                        n_gpu_layers=case.get("n_gpu_layers", -1), type_k=case.get("type_k", "f16"),
                        type_v=case.get("type_v", "f16"), flash_attn=case.get("flash_attn"), options=opts)
        defaults = L.llama_model_default_params
        if case.get("no_alloc"):        # a dry run: sizes without memory (a header-only skeleton loads)
            def dry():
                mp = defaults()
                mp.no_alloc = True
                return mp
            L.llama_model_default_params = dry
        try:
            model = native.load_model(job["model"], plan)
        finally:
            L.llama_model_default_params = defaults
        ctx = native.new_context(model, plan)
        out = {"buffers": read_breakdown(ctx), "log": list(native.log_lines)}
        L.llama_free(ctx)
        L.llama_model_free(model)
        print(json.dumps(out), flush=True)


def reported(model: str, endpoints: list[str], cases: list[dict], timeout: float = 300) -> list[dict]:
    """llama.cpp's buffers per case (dict: n_ctx, n_seq, n_ubatch, tensor_split, n_gpu_layers, and the buffer
    overrides override_tensor, cpu_moe, n_cpu_moe; no_alloc: llama.cpp's dry run, nothing allocated)."""
    payload = json.dumps({"model": model, "endpoints": endpoints, "cases": cases})
    proc = subprocess.run([sys.executable, __file__, payload], capture_output=True, text=True, timeout=timeout,
                          env=_env(), check=False)
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if len(rows) != len(cases):
        raise RuntimeError(f"probe exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return rows


if __name__ == "__main__":
    _probe_main(sys.argv[1])
