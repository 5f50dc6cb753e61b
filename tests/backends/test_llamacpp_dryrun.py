"""llama.cpp's own dry run (localinfer.backends.llamacpp.dryrun) and `localinfer fit`'s use of it.

The dry run agrees with fit's llama.cpp memory model where localinfer has rules (KV of the embedded model,
the weights of a skeleton); for an architecture without rules `fit` shows llama.cpp's numbers on the local
row; refusals, aborts and hangs in llama.cpp become typed errors, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from localinfer.backends.llamacpp import dryrun
from localinfer.backends.llamacpp.dryrun import DryRunRequest, dry_run, parse_result
from localinfer.backends.memory import FitRequest
from localinfer.cli import main
from localinfer.errors import BackendUnavailableError, DryRunError
from tests.support.tiny_archs import HYBRID

needs_llama = pytest.mark.skipif(not dryrun.available(), reason="llama-cpp-python is not installed")
UNCLAIMED = "xverse"      # a llama-style architecture llama.cpp loads and localinfer's rules do not claim
ENV = {**os.environ, "LOCALINFER_DEBUG": ""}


def predicted(path, req: FitRequest):
    from localinfer.backends.llamacpp.memory import breakdown
    from localinfer.devices.profiles import local_device
    from localinfer.model.spec import ModelSpec

    return breakdown(ModelSpec.from_gguf(path), local_device(), req)[0]


@pytest.fixture(scope="module")
def unclaimed(tmp_path_factory):
    from localinfer.model.arch.attention import ARCHS
    from tests.support.ggufgen import write_tiny_model

    assert UNCLAIMED not in ARCHS
    return write_tiny_model(tmp_path_factory.mktemp("dryrun") / f"{UNCLAIMED}.gguf", arch=UNCLAIMED)


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    from tests.support.ggufgen import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("dryrun") / "nosuch.gguf", arch="nosuch-arch")


# ---- the library ---------------------------------------------------------------------------------

CASES = [(512, 1), (2048, 1), (512, 4), (2048, 4)]


@needs_llama
def test_kv_and_weights_of_the_embedded_model_equal_fits_prediction(default_model):
    reqs = [FitRequest(n_ctx=c, n_seq=n, mmap=False) for c, n in CASES]
    results = dry_run(default_model, reqs)          # one subprocess, one load, four contexts
    assert len(results) == len(CASES)
    for req, got in zip(reqs, results):
        want = predicted(default_model, req)
        assert got.kv == want.kv and got.state == 0, (req.n_ctx, req.n_seq)
        assert got.weights == want.weights
        assert got.n_ctx == req.n_ctx * req.n_seq and got.n_ctx_seq == req.n_ctx
        assert got.exact_split and {b.name for b in got.buffers} >= {"CPU"}


@needs_llama
def test_a_skeleton_dry_runs_with_fits_weights(tmp_path):
    from gguf_tools.skeleton import write_skeleton

    path = write_skeleton("qwen3-8b", tmp_path / "q.gguf", type="q4_0")
    req = FitRequest(n_ctx=2048, mmap=False)
    (got,) = dry_run(path, [req])
    want = predicted(path, req)
    assert got.weights == want.weights and got.kv == want.kv
    assert got.weights > 4 << 30            # planned, never read: the file is a header


@needs_llama
@pytest.mark.parametrize("name", sorted(HYBRID))
def test_recurrent_state_beside_kv_equals_fits(tmp_path, name):
    """Mamba2: no KV, the RS buffer alone in the context column (exact).  The hybrids: KV and RS share the CPU
    buffer type, so the state is the log's MiB (±5 KiB) and KV the rest; their sum is exact."""
    from tests.support.ggufgen import write_tiny_arch

    path = write_tiny_arch(tmp_path / f"{name}.gguf", {**HYBRID[name], "vocab_size": 1})
    reqs = [FitRequest(n_ctx=512, n_seq=n, mmap=False) for n in (1, 4)]
    results = dry_run(path, reqs)
    for req, got in zip(reqs, results):
        want = predicted(path, req)
        assert got.weights == want.weights and got.kv + got.state == want.kv + want.state
        assert abs(got.state - want.state) <= 0.005 * (1 << 20) and want.state > 0
        assert got.exact_split == (want.kv == 0)
        if got.exact_split:
            assert got.state == want.state and got.kv == 0


@needs_llama
def test_a_file_llama_cpp_refuses_is_a_typed_error_with_its_message(refused):
    with pytest.raises(DryRunError) as info:
        dry_run(refused, [DryRunRequest(512)])
    assert info.value.reason == "refused"
    assert "unknown model architecture" in str(info.value) and "nosuch-arch" in info.value.refusal
    assert any("nosuch-arch" in line for line in info.value.log)


@needs_llama
def test_a_context_llama_cpp_refuses_is_a_typed_error(unclaimed):
    with pytest.raises(DryRunError) as info:
        dry_run(unclaimed, [DryRunRequest(512, type_v="q8_0", flash_attn=False)])
    assert info.value.reason == "context" and "flash_attn" in str(info.value)


def test_an_abort_or_a_hang_in_the_child_is_a_typed_error(monkeypatch, tmp_path):
    monkeypatch.setattr(dryrun, "available", lambda: True)
    monkeypatch.setattr(dryrun, "_child_argv", lambda: [sys.executable, "-c",
                                                        "import os, sys; sys.stderr.write('GGML_ASSERT(x) failed\\n'); "
                                                        "sys.stderr.flush(); os.abort()"])
    with pytest.raises(DryRunError) as info:
        dry_run(tmp_path / "m.gguf", [DryRunRequest(512)])
    assert info.value.reason == "crashed" and "GGML_ASSERT" in str(info.value)
    monkeypatch.setattr(dryrun, "_child_argv", lambda: [sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(DryRunError) as info:
        dry_run(tmp_path / "m.gguf", [DryRunRequest(512)], timeout=0.5)
    assert info.value.reason == "timeout"


def test_without_llama_cpp_python_the_backend_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(dryrun, "available", lambda: False)
    with pytest.raises(BackendUnavailableError):
        dry_run(tmp_path / "m.gguf", [DryRunRequest(512)])


def test_kv_and_recurrent_state_are_split_by_the_log():
    """A hybrid's KV and RS share the CPU buffer type: the state is the log's MiB, KV the rest of the context
    column; a recurrent-only model's RS buffer is the whole context column, exact."""
    log = ("llama_kv_cache:        CPU KV buffer size =     0.00 MiB\n"
           "llama_memory_recurrent:        CPU RS buffer size =     1.50 MiB\n"
           "llama_context:        CPU  output buffer size =     0.58 MiB\n"
           "llama_context: n_ctx         = 1024\nllama_context: n_ctx_seq     = 1024\n")
    r = parse_result(DryRunRequest(1024), {"CPU": [1000, 5 << 20, 777]}, log)
    assert (r.weights, r.state, r.kv, r.compute) == (1000, 3 << 19, (5 << 20) - (3 << 19), 777)
    assert not r.exact_split and r.output == round(0.58 * (1 << 20)) and (r.n_ctx, r.n_ctx_seq) == (1024, 1024)
    only_rs = parse_result(DryRunRequest(1024), {"CPU": [1000, 1572900, 0]}, log.splitlines()[1])
    assert only_rs.exact_split and only_rs.state == 1572900 and only_rs.kv == 0


# ---- localinfer fit --------------------------------------------------------------------------------

def fit_cli(capsys, *args):
    code = main(["fit", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@needs_llama
def test_fit_shows_llama_cpps_dry_run_for_an_architecture_without_rules(unclaimed, capsys):
    code, out, _ = fit_cli(capsys, unclaimed, "--device", "local", "h100-sxm", "--json")
    assert code == 0
    local, other = json.loads(out)["devices"]
    assert local["source"] == "llama.cpp dry run" and local["generic_terms"] == []
    assert local["measured"]["kv"] == local["breakdown"]["kv"] and local["estimate"]["kv"] > 0
    assert not any("generic rules" in w for w in local["warnings"])
    assert other["source"] == "estimate" and other["generic_terms"] == ["kv", "compute"]
    assert any("generic rules" in w for w in other["warnings"])
    code, out, _ = fit_cli(capsys, unclaimed, "--device", "local", "h100-sxm")
    assert code == 0 and "local (dry run)" in out and "— llama.cpp dry run" in out
    assert out.count("llama.cpp dry run") >= 2 and "h100-sxm (dry run)" not in out


@needs_llama
def test_fit_dry_run_is_forced_with_the_flag_and_only_then(default_model, capsys):
    code, out, _ = fit_cli(capsys, default_model, "--device", "local", "--json")
    assert code == 0 and json.loads(out)["devices"][0]["source"] == "estimate"
    code, out, _ = fit_cli(capsys, default_model, "--device", "local", "--json", "--dry-run", "--no-mmap")
    (local,) = json.loads(out)["devices"]
    assert code == 0 and local["source"] == "llama.cpp dry run"
    assert local["breakdown"]["kv"] == local["estimate"]["kv"]
    assert local["breakdown"]["weights"] == local["estimate"]["weights"]


def test_fit_dry_run_refuses_other_backends_and_devices(default_model, capsys):
    assert fit_cli(capsys, default_model, "--dry-run", "--backend", "torch")[0] == 2
    assert fit_cli(capsys, default_model, "--dry-run", "--device", "h100-sxm")[0] == 2


@needs_llama
def test_fit_on_a_file_llama_cpp_refuses(refused, capsys):
    """With --dry-run: one error line, non-zero, no traceback; without it the estimate stands, with a note."""
    proc = subprocess.run([sys.executable, "-m", "localinfer", "fit", str(refused), "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "unknown model architecture" in errors[0], proc.stderr
    code, out, _ = fit_cli(capsys, refused, "--device", "local")
    assert code == 0 and "llama.cpp will not load this file" in out and "(dry run)" not in out


def test_fit_without_llama_cpp_python_keeps_the_estimate(unclaimed, monkeypatch, capsys):
    monkeypatch.setattr(dryrun, "available", lambda: False)
    code, out, _ = fit_cli(capsys, unclaimed, "--device", "local", "--json")
    (local,) = json.loads(out)["devices"]
    assert code == 0 and local["source"] == "estimate"
    assert any("needs llama-cpp-python" in w for w in local["warnings"])


@needs_llama
def test_fit_with_a_dry_run_imports_no_llama_cpp(unclaimed):
    code = ("import sys, io, contextlib\nfrom localinfer.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()) as out: rc = main(['fit', {str(unclaimed)!r}, "
            "'--device', 'local'])\n"
            "assert rc == 0 and 'dry run' in out.getvalue(), out.getvalue()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'torch', 'mlx')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
