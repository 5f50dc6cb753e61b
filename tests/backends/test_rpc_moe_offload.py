"""MoE experts in host memory (--cpu-moe, --n-cpu-moe, -ot) with loopback RPC workers standing in for GPUs: fit's
bytes per device (weights, KV, compute) equal llama.cpp's own report (``llama_get_memory_breakdown``) on tiny
qwen3moe models (f32: the host part mapped; q4_0: repacked into CPU_REPACK on an AVX2 host) and, as a no_alloc dry
run, on a real-size Qwen3-30B-A3B skeleton and 64/128-expert skeletons; `run` with the experts on the host
decodes the same greedy text as the all-local run, and a pattern or buffer that does not exist is one line."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.rpc_workers import ROOT, reported, workers

pytest.importorskip("llama_cpp")

from gguf import GGMLQuantizationType as Q

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp.rpc_probe import probe
from localinfer.backends.llamacpp.split import split_breakdown
from localinfer.commands._common import plan_request
from localinfer.model.spec import ModelSpec
from localinfer.plan.split_devices import from_workers
from tests.support.ggufgen import write_tiny_arch
from tests.support.tiny_archs import TINY

GiB = 1 << 30
OPTS = ("override_tensor", "cpu_moe", "n_cpu_moe", "mmap", "repack")
TINY_CASES = [
    {"n_ctx": 512, "cpu_moe": True},
    {"n_ctx": 512, "n_cpu_moe": 2},
    {"n_ctx": 512, "n_cpu_moe": 1, "tensor_split": [1, 3]},
    {"n_ctx": 512, "override_tensor": [["blk\\.3\\.ffn_down_exps", "CPU"]]},
    {"n_ctx": 512, "cpu_moe": True, "n_gpu_layers": 3},
    {"n_ctx": 512, "n_ubatch": 16, "n_batch": 16, "cpu_moe": True},
    {"n_ctx": 512, "cpu_moe": True, "mmap": False},
]
DRY = {"no_alloc": True, "mmap": False}      # llama.cpp's dry run maps nothing (llama-model.cpp asserts it)


def _predict(path: str, endpoints: list[str], case: dict):
    spec = ModelSpec.from_gguf(path)
    setup = from_workers([probe(ep) for ep in endpoints])
    plan = LoadPlan(path, n_ctx=case["n_ctx"], n_batch=case.get("n_batch", 512), n_ubatch=case.get("n_ubatch", 512),
                    n_gpu_layers=case.get("n_gpu_layers", -1), options={k: case[k] for k in OPTS if k in case})
    return split_breakdown(spec, setup.devices, plan_request(spec, plan), case.get("tensor_split"),
                           cpu_features=setup.host.cpu_features)


def _check(path: str, endpoints: list[str], cases: list[dict]) -> None:
    for case, row in zip(cases, reported(path, endpoints, cases)):
        sb = _predict(path, endpoints, case)
        got = row["buffers"]
        for d in sb.devices:
            assert (d.weights, d.kv, d.compute) == tuple(got.get(d.name, [0, 0, 0])), (path, case, d.name)
        host = {k: v for k, v in got.items() if not k.startswith("RPC")}
        assert {k.split()[0]: v for k, v in sb.host_weights.items()} == {k: v[0] for k, v in host.items() if v[0]}, \
            (path, case, host)
        assert (sb.host_kv, sb.host_compute) == (sum(v[1] for v in host.values()), sum(v[2] for v in host.values())), \
            (path, case)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-offload")
    spec = {**TINY["qwen3moe"], "n_layers": 4}
    return {"f32": str(write_tiny_arch(d / "f32.gguf", spec)),
            "q4_0": str(write_tiny_arch(d / "q4_0.gguf", {**spec, "n_embd": 256, "expert_ff": 128}, qtype=Q.Q4_0))}


@pytest.fixture(scope="module")
def two_workers():
    with workers(2) as ws:
        yield [ep for _, ep in ws]


@pytest.mark.parametrize("model", ["f32", "q4_0"])
def test_tiny_moe_bytes_per_device_equal_llamacpp(two_workers, tiny, model):
    _check(tiny[model], two_workers, TINY_CASES)


def test_q4_0_experts_on_this_host_are_repacked(two_workers, tiny):
    sb = _predict(tiny["q4_0"], two_workers, {"n_ctx": 512, "cpu_moe": True})
    if "avx2" in from_workers([probe(two_workers[0])]).host.cpu_features:
        assert sb.host_weights["CPU_REPACK model"] > 0
    assert not sb.pipeline           # llama.cpp turns pipeline parallelism off with tensor overrides


def test_dry_runs_of_real_size_and_many_expert_skeletons(tmp_path):
    q30 = tmp_path / "q30.gguf"
    subprocess.run([sys.executable, "-m", "localinfer", "skeleton", "qwen3-30b-a3b", "--type", "q4_0", "-o", str(q30)],
                   check=True, capture_output=True, cwd=ROOT)
    many = {n: str(write_skeleton({"n_layers": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64,
                                   "n_ff": 0, "vocab_size": 1000, "context_length": 4096, "arch": "qwen3moe",
                                   "expert_ff": 128, "type": "f16", "n_expert": n, "n_expert_used": u},
                                  tmp_path / f"e{n}.gguf")) for n, u in ((64, 4), (128, 8))}
    with workers(1, mem=[24 * GiB]) as ws:
        eps = [ep for _, ep in ws]
        _check(str(q30), eps, [{"n_ctx": 4096, "n_cpu_moe": 20, **DRY}, {"n_ctx": 4096, "cpu_moe": True, **DRY},
                               {"n_ctx": 4096, "cpu_moe": True, "n_ubatch": 64, **DRY},
                               {"n_ctx": 4096, "n_cpu_moe": 8, "n_gpu_layers": 40, **DRY}])
        for path in many.values():
            _check(path, eps, [{"n_ctx": 512, "cpu_moe": True, **DRY}, {"n_ctx": 512, "n_cpu_moe": 1, **DRY}])


def _run(args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "localinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, check=False)


def test_greedy_text_with_experts_on_the_host_equals_local(tiny):
    common = ["run", tiny["f32"], "-p", "Hello there", "--raw", "-n", "12", "--temp", "0", "-t", "1", "-c", "512",
              "--json"]
    local = _run(common)
    assert local.returncode == 0, local.stderr
    text = json.loads(local.stdout)["text"]
    with workers(1) as ws:
        ep = ws[0][1]
        for flags in (["--n-cpu-moe", "2"], ["--cpu-moe"], ["-ot", r"blk\.3\.ffn_up_exps=CPU,blk\.2\.ffn_down_exps=CPU"]):
            split = _run(common + ["--rpc", ep, *flags])
            assert split.returncode == 0, (flags, split.stderr)
            doc = json.loads(split.stdout)
            assert doc["text"] == text, flags
            rows = {r["device"]: r for r in doc["devices"]}
            for name in (f"RPC0[{ep}]", "CPU"):
                for key in ("weights", "kv", "compute"):      # the log's MiB have two decimals
                    got, want = rows[name]["reported"][key], rows[name]["predicted"][key]
                    assert abs(got - want) <= 0.005 * (1 << 20) + 1, (flags, name, key)
    local_ot = _run(common + ["--n-cpu-moe", "1"])        # on a CPU alone the overrides change nothing
    assert local_ot.returncode == 0 and json.loads(local_ot.stdout)["text"] == text


@pytest.mark.parametrize("flags, message", [
    (["-ot", "no_such_tensor=CPU"], "error: -ot: 'no_such_tensor' matches no tensor of this model"),
    (["-ot", "ffn_up_exps=CUDA7"], "error: -ot: unknown buffer type 'CUDA7'"),
    (["-ot", "ffn_(up=CPU"], "error: -ot: 'ffn_(up' is not a regular expression"),
    (["-ot", "ffn_up_exps"], "error: -ot 'ffn_up_exps': expected REGEX=BUFFER"),
    (["--n-cpu-moe", "-1"], "error: --n-cpu-moe must be a layer count >= 0"),
])
def test_bad_override_is_one_line_before_loading(tiny, flags, message):
    r = _run(["run", tiny["f32"], "-p", "hi", "-n", "1", *flags])
    assert r.returncode == 2
    assert r.stderr.splitlines()[0].startswith(message), r.stderr
    assert "loading" not in r.stderr


def test_cpu_moe_on_a_dense_model_is_refused():
    r = _run(["run", "-p", "hi", "-n", "1", "--cpu-moe"])
    assert r.returncode == 2 and r.stderr.startswith("error: --cpu-moe: this model has no expert tensors"), r.stderr


def test_serve_reports_each_device_with_experts_on_the_host(tiny):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.serve.test_http_support import start_cli

    with workers(1) as ws:
        ep = ws[0][1]
        p, url = start_cli(tiny["f32"], "-t", "1", "--ctx", "512", "--rpc", ep, "--n-cpu-moe", "3")
        try:
            rows = httpx.get(url + "/v1/engine/state", timeout=30).json()["devices"]
        finally:
            p.terminate()
            assert p.wait(30) == 0
    assert [r["device"] for r in rows] == [f"RPC0[{ep}]", "CPU"]
    for r in rows:
        for kind in ("weights", "kv", "compute"):
            assert f"{r['predicted'][kind] / (1 << 20):.2f}" == f"{r['reported'][kind] / (1 << 20):.2f}", (r, kind)


@pytest.mark.parametrize("arch", ["gpt-oss", "qwen3next", "deepseek2-mla-lite", "llama4", "granitehybrid-moe"])
def test_other_moe_families_weights_and_kv_per_device(two_workers, tmp_path, arch):
    """Expert biases (gpt-oss), shared experts, leading dense layers and hybrids: each device's weights and KV and
    the host's buffers equal llama.cpp's (their compute in a split is the llama graph's replay, not checked)."""
    for qtype in (Q.F32, Q.Q4_0):
        path = str(write_tiny_arch(tmp_path / f"{arch}-{qtype.name}.gguf", TINY[arch], qtype=qtype))
        cases = [{"n_ctx": 512, "cpu_moe": True}, {"n_ctx": 512, "n_cpu_moe": 1},
                 {"n_ctx": 512, "override_tensor": [["ffn_down_exps", "CPU"]], "tensor_split": [1, 2]}]
        for case, row in zip(cases, reported(path, two_workers, cases)):
            sb = _predict(path, two_workers, case)
            got = row["buffers"]
            for d in sb.devices:
                assert (d.weights, d.kv) == tuple(got.get(d.name, [0, 0, 0])[:2]), (arch, qtype, case, d.name)
            host = {k: v[0] for k, v in got.items() if not k.startswith("RPC") and v[0]}
            assert {k.split()[0]: v for k, v in sb.host_weights.items()} == host, (arch, qtype, case)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_0])
def test_gpt_oss_compute_with_expert_biases_and_router_on_the_host(tmp_path, qtype):
    """gpt-oss's expert biases (ADD_ID) and router (ffn_gate_inp, with its bias) run where the overrides put
    them, as llama.cpp's scheduler does: every buffer, compute included, equals llama.cpp's, for --cpu-moe,
    --n-cpu-moe and the partial-layer patterns of --fit (common/fit.cpp's ATTN, UP and GATE)."""
    path = str(write_tiny_arch(tmp_path / f"gpt-oss-{qtype.name}.gguf", TINY["gpt-oss"], qtype=qtype))
    cases = [{"n_ctx": 512, "cpu_moe": True}, {"n_ctx": 512, "n_cpu_moe": 1}] + [
        {"n_ctx": 512, "override_tensor": [[rf"blk\.1\.{frac}", "CPU"]]}
        for frac in (r"ffn_(gate|up|gate_up|down).*", r"ffn_(gate|gate_up|down).*", r"ffn_down.*")]
    with workers(1) as ws:
        _check(path, [ws[0][1]], cases)
