"""Tensor buffer overrides in the plan (no llama.cpp here): arg.cpp's entries for --cpu-moe/--n-cpu-moe, first
match wins, per-tensor bytes on a CUDA profile, the compute growth when host experts are copied up for batches of
32 tokens or more (ggml-cuda's offload_op), never for repacked experts, the command line, fit's flags."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.llamacpp.memory import breakdown, llama_command
from localinfer.backends.llamacpp.overrides import (EXPS_REGEX, buft_overrides, check_overrides, override_of,
                                                    parse_override_tensor)
from localinfer.backends.llamacpp.placement import CUDA_ALIGN, cuda_alloc_size
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import all_devices
from localinfer.errors import UsageError
from localinfer.model.spec import ModelSpec
from localinfer.units import pad_to

SPEC = {"n_layers": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 0, "vocab_size": 1000,
        "context_length": 4096, "arch": "qwen3moe", "expert_ff": 4096, "n_expert": 64, "n_expert_used": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("overrides")
    return {t: ModelSpec.from_gguf(str(write_skeleton({**SPEC, "type": t}, d / f"{t}.gguf"))) for t in ("f16", "q4_0")}


@pytest.fixture(scope="module")
def cuda():
    return all_devices(["rtx-4090"])[0]


def test_n_cpu_moe_takes_the_experts_of_the_first_layers_only():
    entries = buft_overrides(n_cpu_moe=2)
    assert [p for p, _, _ in entries] == [f"blk\\.0{EXPS_REGEX}", f"blk\\.1{EXPS_REGEX}"]
    assert override_of("blk.1.ffn_up_exps.weight", entries) == "CPU"
    assert override_of("blk.11.ffn_up_exps.weight", entries) is None           # blk\.1 then \. : not layer 11
    assert override_of("blk.1.ffn_gate_inp.weight", entries) is None            # the router stays
    assert override_of("blk.1.ffn_up_shexp.weight", entries) is None            # and the shared expert
    assert override_of("blk.0.ffn_gate_up_exps.weight", entries) == "CPU"
    assert override_of("blk.0.ffn_down_exps.bias", entries) == "CPU"            # biases go with them (gpt-oss)


def test_first_matching_entry_wins_in_llama_cpps_order():
    entries = buft_overrides(parse_override_tensor(["blk\\.0\\.ffn_up_exps=CUDA0"]), cpu_moe=True)
    assert override_of("blk.0.ffn_up_exps.weight", entries) == "CUDA0"
    assert override_of("blk.0.ffn_down_exps.weight", entries) == "CPU"
    assert parse_override_tensor("a=CPU,b=CUDA0") == (("a", "CPU"), ("b", "CUDA0"))
    for bad in ("nobuffer", "=CPU", "x(=CPU"):
        with pytest.raises(UsageError) as e:
            parse_override_tensor(bad)
        assert e.value.flag == "-ot"


def test_unknown_buffer_and_unmatched_pattern_name_the_flag(models):
    names = [t.name for t in models["f16"].tensors]
    with pytest.raises(UsageError, match="unknown buffer type 'CUDA1'"):
        check_overrides(names, buft_overrides([("exps", "CUDA1")]), ("CPU", "CUDA0"))
    with pytest.raises(UsageError, match="matches no tensor"):
        check_overrides(names, buft_overrides([("attn_nothing", "CPU")]), ("CPU", "CUDA0"))
    check_overrides(names, buft_overrides(n_cpu_moe=99), ("CPU",))    # layers past the last: llama.cpp's no-op
    with pytest.raises(UsageError) as e:
        check_overrides(["blk.0.ffn_up.weight"], buft_overrides(cpu_moe=True), ("CPU",))
    assert e.value.flag == "--cpu-moe"


def _terms(spec, dev, **kw):
    bd, _ = breakdown(spec, dev, FitRequest(n_ctx=512, **kw))
    return {t.buffer: t for t in bd.terms}


def _cuda_bytes(t) -> int:
    return pad_to(cuda_alloc_size(t.type.name, tuple(t.shape), t.n_bytes), CUDA_ALIGN)


def test_cuda_bytes_per_tensor(models, cuda):
    spec = models["q4_0"]
    full = _terms(spec, cuda)
    moe = _terms(spec, cuda, n_cpu_moe=2)
    moved = [t for t in spec.tensors if "_exps." in t.name and t.name.split(".")[1] in ("0", "1")]
    assert full["CUDA0 model"].bytes - moe["CUDA0 model"].bytes == sum(_cuda_bytes(t) for t in moved)
    host = moe["CPU_Mapped model"]
    assert host.pool == "host"
    assert host.bytes == full["CPU_Mapped model"].bytes + sum(t.n_bytes for t in moved)   # tensors kept on the host
    assert host.reported > host.bytes            # the mapping llama.cpp reports spans the file in between
    assert moe["CUDA0 KV"].bytes == full["CUDA0 KV"].bytes


def test_host_experts_are_copied_up_for_batches_of_32_or_more(models, cuda):
    spec = models["f16"]
    expert = max(t.n_bytes for t in spec.tensors if "_exps." in t.name)
    for ub in (32, 512):
        assert _terms(spec, cuda, cpu_moe=True, n_ubatch=ub, n_batch=512)["CUDA0 compute"].bytes > expert
    small = _terms(spec, cuda, cpu_moe=True, n_ubatch=31, n_batch=512)
    assert small["CUDA0 compute"].bytes < expert                                  # computed on the host instead
    assert small["CPU compute"].bytes > _terms(spec, cuda, n_ubatch=31, n_batch=512)["CPU compute"].bytes


def test_repacked_experts_run_on_the_host_and_are_never_copied(models, cuda):
    spec = models["q4_0"]
    expert = max(t.n_bytes for t in spec.tensors if "_exps." in t.name)
    avx2 = replace(cuda, cpu_features=("avx2",))
    terms = _terms(spec, avx2, cpu_moe=True)
    assert terms["CPU_REPACK model"].bytes == sum(pad_to(t.n_bytes, 32) for t in spec.tensors if "_exps." in t.name)
    assert terms["CUDA0 compute"].bytes < expert
    assert _terms(spec, cuda, cpu_moe=True)["CUDA0 compute"].bytes > expert   # mapped: a host buffer, copied


def test_command_prints_the_flags(models, cuda):
    req = FitRequest(n_ctx=512, override_tensor=(("blk\\.3\\.ffn_up_exps", "CPU"),), cpu_moe=True, n_cpu_moe=3)
    cmd = llama_command(models["f16"], req, None, cuda)
    assert cmd.endswith("-ot 'blk\\.3\\.ffn_up_exps=CPU' --cpu-moe --n-cpu-moe 3")


def test_fit_takes_the_flags(models, tmp_path):
    path = tmp_path / "m.gguf"
    write_skeleton({**SPEC, "type": "f16"}, path)
    out = subprocess.run([sys.executable, "-m", "localinfer", "fit", str(path), "--device", "rtx-4090", "--n-cpu-moe",
                          "2", "-ot", "blk\\.3\\.ffn_down_exps=CPU", "--json"], capture_output=True, text=True,
                         check=True)
    doc = json.loads(out.stdout)
    dev = doc["devices"][0]
    text = json.dumps(dev)
    assert "--n-cpu-moe 2" in text and "-ot 'blk\\\\.3\\\\.ffn_down_exps=CPU'" in text
    bad = subprocess.run([sys.executable, "-m", "localinfer", "fit", str(path), "--device", "rtx-4090", "-ot",
                          "exps=CUDA3"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: -ot: unknown buffer type 'CUDA3'")
