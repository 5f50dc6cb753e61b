"""llama.cpp's own dry run: what it would allocate for a model and a context, per buffer type, on this machine.

``dry_run(path, requests)`` starts one subprocess (:mod:`localinfer.backends.llamacpp.dryrun_child`) that
loads the model once with ``no_alloc`` (no weight is read, so header-only skeletons work) and creates a
context per request.  Each answer is a :class:`DryRunResult`: per buffer type the weights (the breakdown's
model column), KV and recurrent state (its context column, split by the log's ``KV buffer size`` and
``RS buffer size`` lines), compute, plus the output buffer and llama.cpp's n_ctx / n_ctx_seq.  A refusal,
an abort or a hang in llama.cpp becomes a :class:`localinfer.errors.DryRunError` carrying the last error
lines of its log; this process never imports llama_cpp.

Exactness: weights, compute, and KV or state alone on a buffer type are llama.cpp's bytes.  Where KV and
recurrent state share a buffer type (hybrid models), the state is the log's MiB with two decimals (±5 KiB)
and KV the rest (``exact_split`` False).  The output buffer is always the log's MiB (``output_exact``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from localinfer.backends.memory import MemoryBreakdown, Term
from localinfer.errors import BackendUnavailableError, DryRunError, UsageError

MiB = 1 << 20
DEFAULT_TIMEOUT = 120.0
CHILD = "localinfer.backends.llamacpp.dryrun_child"
_PKG_ROOT = str(Path(__file__).resolve().parents[3])

_KV_RE = re.compile(r"(\S+) KV buffer size =\s+[\d.]+ MiB")
_RS_RE = re.compile(r"(\S+) RS buffer size =\s+([\d.]+) MiB")
_OUT_RE = re.compile(r"(\S+)\s+output buffer size =\s+([\d.]+) MiB")
_NCTX_RE = re.compile(r"n_ctx\s+= (\d+)")
_NCTX_SEQ_RE = re.compile(r"n_ctx_seq\s+= (\d+)")


@dataclass(frozen=True)
class DryRunRequest:
    """One context to plan: ``n_ctx`` tokens per sequence (llama.cpp gets ``n_ctx × n_seq``), as FitRequest."""

    n_ctx: int = 4096
    n_seq: int = 1
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool | None = None      # None: llama.cpp's auto
    n_batch: int = 2048
    n_ubatch: int = 512
    n_outputs_max: int | None = None    # None: llama.cpp's default
    swa_full: bool = False
    kv_unified: bool = False

    @classmethod
    def from_fit(cls, req) -> DryRunRequest:
        """The context of a :class:`localinfer.backends.memory.FitRequest`."""
        n_ctx = -(-req.llama_n_ctx // req.n_seq)
        return cls(n_ctx, req.n_seq, req.type_k, req.type_v, req.flash_attn, req.n_batch, req.n_ubatch,
                   req.n_outputs_max, req.swa_full, req.kv_unified)

    def payload(self) -> dict:
        from gguf import GGMLQuantizationType

        out = dict(self.__dict__)
        for key in ("type_k", "type_v"):
            try:
                out[key + "_id"] = int(GGMLQuantizationType[str(out[key]).upper()])
            except KeyError:
                raise UsageError(f"unknown cache type {out[key]!r}", flag="-ctk" if key == "type_k" else "-ctv")
        return out


@dataclass(frozen=True)
class BufferBytes:
    """What llama.cpp plans in one buffer type ("CPU", "CPU_REPACK", "CUDA0", ...)."""

    name: str
    weights: int = 0
    kv: int = 0
    state: int = 0          # recurrent state (RS buffers)
    compute: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.compute


@dataclass(frozen=True)
class DryRunResult:
    """llama.cpp's plan for one request: its buffers, output buffer and context size."""

    request: DryRunRequest
    buffers: tuple[BufferBytes, ...]
    output: int                 # host output buffer (logits), bytes from the log's MiB
    output_buffer: str          # its buffer type, e.g. "CPU"
    n_ctx: int
    n_ctx_seq: int
    exact_split: bool = True    # False: KV and state share a buffer type and the state is the log's MiB
    output_exact: bool = False
    log: str = field(default="", repr=False, compare=False)

    def _sum(self, key: str) -> int:
        return sum(getattr(b, key) for b in self.buffers)

    @property
    def weights(self) -> int:
        return self._sum("weights")

    @property
    def kv(self) -> int:
        return self._sum("kv")

    @property
    def state(self) -> int:
        return self._sum("state")

    @property
    def compute(self) -> int:
        return self._sum("compute")

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.compute + self.output

    def buffer(self, name: str) -> BufferBytes | None:
        return next((b for b in self.buffers if b.name == name), None)

    def to_dict(self) -> dict:
        return {"request": dict(self.request.__dict__), "buffers": [dict(b.__dict__) for b in self.buffers],
                "weights": self.weights, "kv": self.kv, "state": self.state, "compute": self.compute,
                "output": self.output, "output_buffer": self.output_buffer, "total": self.total,
                "n_ctx": self.n_ctx, "n_ctx_seq": self.n_ctx_seq, "exact_split": self.exact_split,
                "output_exact": self.output_exact}


@dataclass(frozen=True)
class DryRunJob:
    """One model to load (once) and its requests; ``mmap`` does a real mmap load instead of the dry run."""

    path: str
    requests: tuple[DryRunRequest, ...]
    n_gpu_layers: int = -1
    repack: bool = True
    mmap: bool = False


def available() -> bool:
    """Whether llama-cpp-python is installed (checked without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def parse_result(request: DryRunRequest, buffers: dict, log: str) -> DryRunResult:
    """A result from the breakdown (buffer type → [model, context, compute]) and the context's log."""
    kv_names = set(_KV_RE.findall(log))
    rs = {}
    for name, mib in _RS_RE.findall(log):
        rs[name] = rs.get(name, 0) + round(float(mib) * MiB)
    out, exact = [], True
    for name, (model, context, compute) in buffers.items():
        state = 0
        if name in rs:
            state = context if name not in kv_names else min(context, rs[name])
            exact = exact and name not in kv_names
        out.append(BufferBytes(name, model, context - state, state, compute))
    found = _OUT_RE.findall(log)
    output = sum(round(float(mib) * MiB) for _, mib in found)
    n_ctx = [int(x) for x in _NCTX_RE.findall(log)]
    n_seq = [int(x) for x in _NCTX_SEQ_RE.findall(log)]
    return DryRunResult(request, tuple(out), output, found[0][0] if found else "", n_ctx[0] if n_ctx else 0,
                        n_seq[0] if n_seq else 0, exact, log=log)


def _refusal(errors: list[str]) -> str:
    """The most telling line of llama.cpp's error log: its reason, without the function prefixes."""
    lines = [re.sub(r"^(\w+: )+", "", e).strip() for e in errors]
    lines = [x for x in lines if x and not x.startswith("failed to load model")] or lines
    reason = next((x.partition("error loading model: ")[2] for x in lines if "error loading model: " in x), "")
    return reason or (lines[-1] if lines else "no message")


def _child_argv() -> list[str]:
    return [sys.executable, "-m", CHILD]


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH")) if p)
    return env


def run_jobs(jobs: list[DryRunJob], timeout: float = DEFAULT_TIMEOUT) -> list[list[DryRunResult | DryRunError]]:
    """Every job in one subprocess: per job, a result or the error for each request (a crash cannot reach us)."""
    if not available():
        raise BackendUnavailableError("llama.cpp's dry run needs llama-cpp-python, which is not installed",
                                      hint="pip install llama-cpp-python, or drop --dry-run")
    payload = json.dumps([{"path": str(j.path), "n_gpu_layers": j.n_gpu_layers, "repack": j.repack,
                           "mmap": j.mmap, "requests": [r.payload() for r in j.requests]} for j in jobs])
    proc = subprocess.Popen(_child_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_child_env())
    timed_out = False
    try:
        stdout, stderr = proc.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        timed_out = True
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    loads = {x["job"]: x for x in lines if "loaded" in x}
    answers = {(x["job"], x["request"]): x for x in lines if "request" in x}
    tail = [x for x in stderr.strip().splitlines() if x.strip()][-4:]
    if timed_out:
        gone = DryRunError(f"llama.cpp's dry run ran past {timeout:g} s", reason="timeout", refusal="",
                           log=tuple(tail), hint="a larger timeout, or a smaller model")
    else:
        last = f": {tail[-1].strip()}" if tail else ""
        gone = DryRunError(f"llama.cpp's dry run exited with status {proc.returncode}{last}", reason="crashed",
                           refusal="", log=tuple(tail), returncode=proc.returncode,
                           hint="llama.cpp aborted or was killed while planning; the error's log holds its last lines")
    out: list[list] = []
    for i, job in enumerate(jobs):
        row: list = []
        load = loads.get(i)
        for j, req in enumerate(job.requests):
            ans = answers.get((i, j))
            if load is not None and not load["loaded"]:
                why = _refusal(load["error"])
                row.append(DryRunError(f"llama.cpp cannot load {Path(job.path).name}: {why}", refusal=why,
                                       reason="refused", path=str(job.path), log=tuple(load["error"]),
                                       hint="llama.cpp does not know this file's architecture or tensors"))
            elif ans is None:
                row.append(gone)
            elif not ans["ok"]:
                why = _refusal(ans["error"])
                row.append(DryRunError(f"llama.cpp cannot create the context: {why}", refusal=why,
                                       reason="context", path=str(job.path), log=tuple(ans["error"]), request=req))
            else:
                row.append(parse_result(req, ans["buffers"], ans["log"]))
        out.append(row)
    return out


def _host_buffer(name: str) -> bool:
    return name.startswith("CPU") or name.endswith("_Host")


def to_breakdown(result: DryRunResult, device, *, mmap: bool = False) -> MemoryBreakdown:
    """A MemoryBreakdown of llama.cpp's own plan, one term per buffer type and kind, for ``device`` (this machine):
    host buffers (CPU*, *_Host) go to the host pool of a discrete device, the rest to the device."""
    unified = device.unified or device.kind == "cpu"

    def pool(name: str) -> str:
        return "device" if unified or not _host_buffer(name) else "host"

    src = "llama.cpp dry run, llama_get_memory_breakdown"
    terms = []
    for b in result.buffers:
        for key, label, nbytes, how in (
                ("weights", f"weights ({b.name})", b.weights, "model column"),
                ("kv", "KV cache", b.kv, "context column" + ("" if result.exact_split else " less the RS buffer")),
                ("state", "recurrent state", b.state, "RS buffer" + ("" if result.exact_split else
                                                                      " (log, MiB with two decimals)")),
                ("compute", "compute buffer", b.compute, "compute column")):
            if nbytes:
                suffix = {"weights": "model", "kv": "KV", "state": "RS", "compute": "compute"}[key]
                terms.append(Term(key, label, nbytes, pool(b.name), f"{src}: {how}", f"{b.name} {suffix}"))
    if result.output:
        name = result.output_buffer or "CPU"
        terms.append(Term("output", "output buffer (logits)", result.output, pool(name),
                          "llama.cpp's log: output buffer size (MiB, two decimals)", f"{name} output"))
    notes = []
    if mmap:
        notes.append("llama.cpp's dry run reads no weights, so it plans them as loaded without mmap (-lm none); "
                     "with mmap the CPU model buffer is the file mapping instead")
    return MemoryBreakdown(tuple(terms), unified, tuple(notes))


def dry_run(path: str | os.PathLike, requests, *, timeout: float = DEFAULT_TIMEOUT, n_gpu_layers: int = -1,
            repack: bool = True) -> tuple[DryRunResult, ...]:
    """llama.cpp's plan for each request (DryRunRequest, or FitRequest), loading ``path`` once without
    reading its weights.  Raises DryRunError (the first failure) or BackendUnavailableError."""
    reqs = tuple(r if isinstance(r, DryRunRequest) else DryRunRequest.from_fit(r) for r in requests)
    results = run_jobs([DryRunJob(str(path), reqs, n_gpu_layers, repack)], timeout)[0]
    for r in results:
        if isinstance(r, DryRunError):
            raise r
    return tuple(results)
