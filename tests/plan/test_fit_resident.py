"""fit on a CPU: the verdict counts what must stay resident; the mapped total is information.

llama.cpp repacks some weights into an anonymous CPU_REPACK buffer and never reads
their mapped pages again; token embeddings are read a row per token.  These tests
work from real GGUF files (tests/support/ggufgen.py) and a CPU profile whose
SIMD features are given, so they do not depend on this machine's CPU.
"""

import json
from dataclasses import replace

import pytest
from gguf import GGMLQuantizationType as T

from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp.memory import breakdown, llama_command
from localinfer.backends.llamacpp.placement import repackable
from localinfer.backends.memory import FitRequest, MemoryBreakdown, Term
from localinfer.cli import main
from localinfer.devices.profiles import local_device
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit import check_load, fit_device
from localinfer.units import GiB, pad_to
from tests.support.ggufgen import write_tiny_model


def cpu(features=("avx2",), memory=16 * GiB):
    return replace(local_device(), name="cpu-test", kind="cpu", unified=True, cpu_features=tuple(features),
                   memory_bytes=memory, reserve="0%", working_set_cap_bytes=None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("resident")
    out = {}
    # 264 tokens: the output matrix has a multiple of 8 rows, so it is repacked too
    out["q4_0"] = write_tiny_model(d / "q4_0.gguf", qtype=T.Q4_0, n_extra_tokens=5)
    out["q4_k"] = write_tiny_model(d / "q4_k.gguf", qtype=T.Q4_K, output_qtype=T.Q6_K, n_extra_tokens=5,
                                   overrides={"attn_v": T.Q6_K})
    out["tied_q8"] = write_tiny_model(d / "tied_q8.gguf", qtype=T.Q8_0, tied=True, n_extra_tokens=5)
    out["tied_q4"] = write_tiny_model(d / "tied_q4.gguf", qtype=T.Q4_0, tied=True, n_extra_tokens=5)
    return {k: ModelSpec.from_gguf(v) for k, v in out.items()}


def split(spec, features=("avx2",)):
    """(repacked, mapped and read after load, row-read embeddings) tensors, from the header alone."""
    rep, read, rows = [], [], []
    for t in spec.tensors:
        matmul = len(t.shape) >= 2 and not t.name.startswith("token_embd") and "norm" not in t.name
        if matmul and repackable(t.type.name, tuple(t.shape), features):
            rep.append(t)
        elif t.name.startswith("token_embd"):
            rows.append(t)
        else:
            read.append(t)
    return rep, read, rows


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_resident_leaves_out_the_mapped_pages_of_repacked_tensors_and_embeddings(models, name):
    spec = models[name]
    bd, _ = breakdown(spec, cpu(), FitRequest(n_ctx=512))
    rep, read, rows = split(spec)
    assert rep and read and rows
    terms = {t.buffer: t for t in bd.terms if t.buffer}
    mapped, repack = terms["CPU_Mapped model"], terms["CPU_REPACK model"]
    assert repack.bytes == sum(pad_to(t.n_bytes, 32) for t in rep) and repack.resident is None   # anonymous
    assert mapped.resident == sum(t.n_bytes for t in read)            # output (if plain), norms: read every token
    assert mapped.bytes > mapped.resident + sum(t.n_bytes for t in rows)   # the range spans the repacked ones
    assert bd.mapped_bytes == bd.total                                 # llama.cpp's buffer report, unchanged
    assert bd.resident_bytes == bd.total - mapped.bytes + mapped.resident == bd.device_bytes
    assert bd.load_peak == 0                                           # mmap: the source is the page cache


def test_the_verdict_uses_resident_memory_and_says_the_mapped_total(models):
    spec = models["q4_0"]
    bd, _ = breakdown(spec, cpu(), FitRequest(n_ctx=512))
    between = cpu(memory=(bd.resident_bytes + bd.mapped_bytes) // 2)
    r = fit_device(spec, between, FitRequest(n_ctx=512))
    assert r.fits and r.needed == bd.resident_bytes and "resident" in r.reason
    d = r.to_dict()
    assert (d["resident_bytes"], d["mapped_bytes"]) == (bd.resident_bytes, bd.mapped_bytes)
    assert d["breakdown"]["mapped_bytes"] == d["breakdown"]["total"]
    assert not fit_device(spec, cpu(memory=bd.resident_bytes - 1), FitRequest(n_ctx=512)).fits


def test_without_repacking_hardware_nothing_changes_but_the_embeddings(models):
    spec = models["q4_0"]
    bd, _ = breakdown(spec, cpu(features=()), FitRequest(n_ctx=512))
    embd = spec.tensor("token_embd.weight").n_bytes
    assert "CPU_REPACK model" not in {t.buffer for t in bd.terms}
    assert bd.resident_bytes == bd.mapped_bytes - embd


def test_load_modes(models):
    spec = models["q4_0"]
    dev = cpu()
    rep, _read, rows = split(spec)
    base, _ = breakdown(spec, dev, FitRequest(n_ctx=512))
    locked, _ = breakdown(spec, dev, FitRequest(n_ctx=512, mlock=True))
    assert locked.resident_bytes == locked.mapped_bytes == base.mapped_bytes      # the whole range is locked
    none, _ = breakdown(spec, dev, FitRequest(n_ctx=512, mmap=False))
    weights = sum(pad_to(t.n_bytes, 32) for t in spec.tensors)
    assert none.sum("weights") == weights and none.resident_bytes == none.mapped_bytes   # all anonymous
    assert none.load_peak == weights + max(t.n_bytes for t in rep)          # one tensor staged before repacking
    off, _ = breakdown(spec, dev, FitRequest(n_ctx=512, repack=False))
    assert "CPU_REPACK model" not in {t.buffer for t in off.terms}
    assert off.resident_bytes == off.mapped_bytes - sum(t.n_bytes for t in rows)
    nb = [t.bytes for t in base.terms if t.key != "weights"]
    assert nb == [t.bytes for t in off.terms if t.key != "weights"]           # KV, compute, output unchanged


def test_the_load_peak_counts_when_it_is_the_larger():
    terms = (Term("weights", "w", 100, "device", ""), Term("kv", "kv", 10, "device", ""))
    assert MemoryBreakdown(terms, True, (), 150).device_bytes == 150
    assert MemoryBreakdown(terms, True, (), 90).device_bytes == 110


def test_a_tied_output_reads_the_embeddings_whole_unless_it_is_repacked(models):
    embd = lambda spec: spec.tensor("token_embd.weight").n_bytes
    q8, q4 = models["tied_q8"], models["tied_q4"]
    bd8, _ = breakdown(q8, cpu(), FitRequest(n_ctx=512))                   # Q8_0: not repacked on x86
    assert "CPU_REPACK model" not in {t.buffer for t in bd8.terms} and bd8.resident_bytes == bd8.mapped_bytes
    bd4, _ = breakdown(q4, cpu(), FitRequest(n_ctx=512))                   # the tied copy is repacked
    m = next(t for t in bd4.terms if t.buffer == "CPU_Mapped model")
    assert m.bytes - m.resident >= embd(q4)


def test_fit_compares_the_load_modes_and_suggests_one_that_fits(models):
    spec = models["q4_0"]
    dev = cpu()
    r = fit_device(spec, dev, FitRequest(n_ctx=512, mlock=True))
    labels = [o.label for o in r.load_options]
    assert labels[0] == "-lm mmap+mlock" and r.load_options[0].current
    assert set(labels) == {"-lm mmap", "-lm mmap+mlock", "-lm none", "-lm mlock", "-lm mmap+mlock --no-repack"}
    off = fit_device(spec, dev, FitRequest(n_ctx=512, repack=False)).load_options
    assert [o.label for o in off if o.current] == ["-lm mmap --no-repack"] and off[-1].label == "-lm mmap --repack"
    default = next(o for o in r.load_options if o.label == "-lm mmap")
    tight = replace(dev, memory_bytes=default.needed + 1)
    r = fit_device(spec, tight, FitRequest(n_ctx=512, mlock=True))
    assert not r.fits and "-lm mmap" in r.suggestions


def test_command_line_flags(models):
    spec = models["q4_0"]
    dev = cpu()
    cmd = lambda **kw: llama_command(spec, FitRequest(n_ctx=512, **kw), None, dev)
    assert "-lm" not in cmd() and "--no-repack" not in cmd()
    assert "-lm none" in cmd(mmap=False) and "-lm mmap+mlock" in cmd(mlock=True)
    assert "-lm mlock" in cmd(mmap=False, mlock=True) and "--no-repack" in cmd(repack=False)


def test_run_checks_the_resident_figure_with_the_plans_load_mode(models):
    spec = models["q4_0"]
    bd, _ = breakdown(spec, cpu(), FitRequest(n_ctx=512, n_outputs_max=64, swa_full=True))
    between = cpu(memory=(bd.resident_bytes + bd.mapped_bytes) // 2)
    plan = LoadPlan(model_path=spec.path, n_ctx=512)
    assert check_load(spec, plan, device=between).fits
    locked = check_load(spec, replace(plan, options={"mlock": True}), device=between)
    assert not locked.fits and locked.request.mlock and "-lm mmap" in locked.suggestions


def test_fit_cli_flags_text_and_json(models, capsys):
    spec = models["q4_0"]
    assert main(["fit", spec.path, "--device", "local", "--ctx", "512", "--no-mmap", "--no-repack", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    req = doc["request"]
    assert (req["mmap"], req["mlock"], req["repack"]) == (False, False, False)
    dev = doc["devices"][0]
    assert dev["resident_bytes"] == dev["breakdown"]["resident_bytes"] and "mapped_bytes" in dev
    assert "-lm none --no-repack" in dev["command"]
    assert main(["fit", spec.path, "--device", "local", "--load-mode", "none", "--mlock"]) != 0
    assert "error: give either --load-mode or --no-mmap/--mlock" in capsys.readouterr().err
    if local_device().kind == "cpu" and "avx2" in local_device().cpu_features:
        assert main(["fit", spec.path, "--device", "local", "--ctx", "512"]) == 0
        text = capsys.readouterr().out
        assert "resident" in text and "mapped" in text and "load options: -lm mmap (as asked)" in text


def test_run_flags_become_the_plans_load_options(models):
    import argparse

    from localinfer.commands import _common

    p = argparse.ArgumentParser()
    _common.add_model_args(p)
    spec = models["q4_0"]
    plan = _common.plan_from(p.parse_args([spec.path, "--load-mode", "none", "--no-repack"]), spec.path, spec)
    assert plan.options == {"mmap": False, "mlock": False, "repack": False}
    assert _common.plan_from(p.parse_args([spec.path]), spec.path, spec).options == {}


def test_plan_and_report_show_resident_beside_mapped(models, capsys):
    local = local_device()
    if local.kind != "cpu" or "avx2" not in local.cpu_features:
        pytest.skip("this machine's CPU does not repack Q4_0")
    path = models["q4_0"].path
    main(["plan", path, "--device", "local", "--requests", "1", "--input", "64", "--output", "8", "--json"])
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["resident_bytes"] < memory["mapped_bytes"] and "resident" in memory["note"]
    assert main(["report", path, "--devices", "local", "--ctx", "512", "--format", "json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("resident (counted)" in n and "mapped" in n for n in notes)
