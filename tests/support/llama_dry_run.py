"""llama.cpp's no-alloc dry run of a GGUF, in a subprocess so that a crash in llama.cpp cannot take pytest down.

``dry_run(path)`` loads the model with ``no_alloc`` (no tensor data is read, so a sparse skeleton works), creates
a context and reports what llama.cpp said: whether both steps succeeded, ``llama_model_n_params``, and the
sizes llama.cpp logs for the attention KV cache and the recurrent state ("llama_kv_cache: size =",
"llama_memory_recurrent: size =")
(``llama-kv-cache.cpp``, ``llama-memory-recurrent.cpp``).  Same calls as ``benchmarks/fit_accuracy.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def dry_run(path: str | Path, *, n_ctx: int = 256, n_seq: int = 1, timeout: float = 120) -> dict:
    """{"loaded", "context", "n_params", "kv_mib", "rs_mib", "log"} for the model at ``path``."""
    job = json.dumps({"path": str(path), "n_ctx": n_ctx, "n_seq": n_seq})
    proc = subprocess.run([sys.executable, __file__, job], check=False, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"loaded": False, "context": False, "error": f"exit {proc.returncode}",
                "log": (proc.stderr + proc.stdout)[-3000:]}
    return json.loads(lines[-1])


def _main(job_json: str) -> None:
    import llama_cpp as L

    job = json.loads(job_json)
    logs: list[str] = []

    @L.llama_log_callback
    def on_log(level, text, user):
        logs.append(text.decode(errors="replace"))

    L.llama_log_set(on_log, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.no_alloc, mp.load_mode = True, L.LLAMA_LOAD_MODE_NONE
    model = L.llama_model_load_from_file(job["path"].encode(), mp)
    out: dict = {"loaded": bool(model), "context": False}
    if model:
        out["n_params"] = int(L.llama_model_n_params(model))
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.n_batch, cp.n_ubatch = job["n_ctx"] * job["n_seq"], job["n_seq"], 256, 256
        ctx = L.llama_init_from_model(model, cp)
        out["context"] = bool(ctx)
        if ctx:
            L.llama_free(ctx)
        L.llama_model_free(model)
    text = "".join(logs)
    # the buffer lines read 0.00 MiB under no_alloc for the KV cache; the "size =" summaries always hold the total
    out["kv_mib"] = [float(x) for x in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", text)]
    out["rs_mib"] = [float(x) for x in re.findall(r"llama_memory_recurrent: size =\s+([\d.]+) MiB", text)]
    out["log"] = text[-3000:] if not out["context"] else ""
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
