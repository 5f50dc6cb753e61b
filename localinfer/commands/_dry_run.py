"""`localinfer fit`'s local row from llama.cpp's own dry run (``--dry-run``, or an architecture without rules).

llama.cpp plans every buffer for this machine without reading a weight
(:mod:`localinfer.backends.llamacpp.dryrun`, in a subprocess: this process never imports llama_cpp), so
for an architecture localinfer has no byte rules for, the ``local`` row becomes llama.cpp's numbers and
the other devices keep the portable estimate (``generic_terms`` names its generic terms).  When the dry
run cannot answer (llama-cpp-python missing, a crash, a hang, or llama.cpp refusing the file) the estimate
stays, with a note; with ``--dry-run`` a refusal is the command's error, as the user asked for llama.cpp's
verdict.
"""

from __future__ import annotations

from dataclasses import replace

from localinfer.devices.profiles import LOCAL_NAME
from localinfer.errors import BackendUnavailableError, DryRunError, UsageError
from localinfer.units import fmt_bytes

SOURCE = "llama.cpp dry run"
GENERIC_MARK = "generic rules"     # the spec's note on an architecture no family claims (ModelSpec.missing)


def local_dry_run(spec, req, results: list, *, forced: bool) -> list:
    """``results`` with the local row judged on llama.cpp's dry run, or with a note saying why it is not."""
    from localinfer.backends.llamacpp import dryrun
    from localinfer.plan.fit import with_breakdown

    if forced and req.backend != "llama.cpp":
        raise UsageError(f"--dry-run asks llama.cpp, not the {req.backend} backend", flag="--dry-run",
                         hint="drop --backend, or drop --dry-run")
    at = next((i for i, r in enumerate(results) if r.device.name == LOCAL_NAME), None)
    if at is None:
        if forced:
            raise UsageError("--dry-run plans this machine: the devices asked for do not include it",
                             flag="--dry-run", hint="add --device local, or drop --dry-run")
        return results
    row = results[at]
    ngl = 0 if row.device.kind == "cpu" else req.n_gpu_layers
    try:
        (measured,) = dryrun.dry_run(spec.path, [req], n_gpu_layers=ngl, repack=req.repack)
    except DryRunError as exc:
        if forced and exc.reason in ("refused", "context"):
            raise
        what = (f"llama.cpp will not load this file: {exc.refusal}" if exc.reason == "refused" else
                f"llama.cpp's dry run did not answer ({exc})")
        return _noted(results, at, f"{what}; this row is localinfer's estimate")
    except BackendUnavailableError:
        return _noted(results, at, "llama.cpp's dry run needs llama-cpp-python, which is not installed; "
                                   "this row is localinfer's estimate")
    bd = dryrun.to_breakdown(measured, row.device, mmap=req.mmap)
    warnings = tuple(w for w in row.warnings if GENERIC_MARK not in w)
    est = row.breakdown
    terms = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in (("weights", est.weights), ("KV", est.kv),
                                                         ("state", est.state), ("compute", est.compute),
                                                         ("output", est.output)) if v or k != "state")
    warnings += (f"{SOURCE}: llama.cpp's own plan for this machine (llama_get_memory_breakdown, n_ctx "
                 f"{measured.n_ctx}); localinfer's estimate: {terms}; the largest context, most sequences and "
                 "KV type searches are the estimate's",)
    out = list(results)
    out[at] = with_breakdown(spec, row, bd, SOURCE, measured=measured.to_dict(), warnings=warnings)
    return out


def _noted(results: list, at: int, note: str) -> list:
    out = list(results)
    out[at] = replace(out[at], warnings=out[at].warnings + (note,))
    return out
