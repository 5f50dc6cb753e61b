"""A model split across two loopback llama.cpp RPC workers (1 thread each): fit's bytes per device equal what
llama.cpp allocates, for the default split, uneven --tensor-splits and a partial -ngl, on the embedded model,
a MoE, a model with an untied output, Q/K/V biases, per-layer rope_freqs with a tied output, and gemma3's
sliding-window layers, with quantized KV, without flash attention and with sequences that do not divide the
ubatch; greedy output equals the local run."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.rpc_workers import ROOT, reported, workers

pytest.importorskip("llama_cpp")

from gguf import GGMLQuantizationType

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.engine import LoadPlan
from localinfer.backends.llamacpp.rpc_probe import probe
from localinfer.backends.llamacpp.split import split_breakdown
from localinfer.commands._common import plan_request
from localinfer.model.sources import resolve_model
from localinfer.model.spec import ModelSpec
from localinfer.plan.split_devices import from_workers
from tests.plan.test_fit_llamacpp import write_tiny_gemma3
from tests.support.ggufgen import write_tiny_model

CASES = [
    {"n_ctx": 512},
    {"n_ctx": 1024, "tensor_split": [1, 3]},
    {"n_ctx": 768, "tensor_split": [5, 1]},
    {"n_ctx": 512, "n_gpu_layers": 20},
    {"n_ctx": 1024, "n_seq": 2, "n_ubatch": 128, "n_batch": 256},
]


@pytest.fixture(scope="module")
def two_workers():
    with workers(2) as ws:
        yield [ep for _, ep in ws]


def write_split_models(d) -> dict[str, str]:
    """The models the split is checked on, written under ``d`` (the embedded one besides): name -> path."""
    moe = write_skeleton({"n_layers": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 0,
                          "vocab_size": 1000, "context_length": 4096, "arch": "qwen3moe", "n_expert": 8,
                          "n_expert_used": 2, "expert_ff": 128, "type": "f16"}, d / "moe.gguf")
    untied = write_tiny_model(d / "untied.gguf", arch="qwen3", n_layers=6, qtype=GGMLQuantizationType.Q8_0)
    qwen2 = write_tiny_model(d / "qwen2.gguf", arch="qwen2", n_layers=4, qtype=GGMLQuantizationType.Q8_0)
    rope = write_tiny_model(d / "rope.gguf", arch="llama", n_layers=4, qtype=GGMLQuantizationType.Q4_0,
                            rope_freqs=True, tied=True)
    gemma = write_tiny_gemma3(d / "gemma3.gguf")
    return {"smollm2": str(resolve_model(None)), "qwen3moe": str(moe), "qwen3-untied": str(untied),
            "qwen2-bias": str(qwen2), "llama-rope-freqs-tied": str(rope), "gemma3-iswa": str(gemma)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_split_models(tmp_path_factory.mktemp("split"))


def _predict(path: str, endpoints: list[str], case: dict):
    spec = ModelSpec.from_gguf(path)
    setup = from_workers([probe(ep) for ep in endpoints])
    plan = LoadPlan(path, n_ctx=case["n_ctx"], n_seq=case.get("n_seq", 1), n_batch=case.get("n_batch", 512),
                    n_ubatch=case.get("n_ubatch", 512), n_gpu_layers=case.get("n_gpu_layers", -1),
                    type_k=case.get("type_k", "f16"), type_v=case.get("type_v", "f16"),
                    flash_attn=case.get("flash_attn"))
    return split_breakdown(spec, setup.devices, plan_request(spec, plan), case.get("tensor_split"),
                           cpu_features=setup.host.cpu_features)


MORE = {"smollm2": [{"n_ctx": 512, "type_k": "q8_0", "type_v": "q8_0"}, {"n_ctx": 512, "flash_attn": False},
                    # 3 sequences: the graph llama.cpp reserves has 513 tokens (a multiple of n_seq_max); 10 of
                    # them with -ub 8: the decode graph (10 tokens, 10 logit rows) is the larger one
                    {"n_ctx": 768, "n_seq": 3}, {"n_ctx": 2560, "n_seq": 10, "n_ubatch": 8, "n_batch": 8,
                                                 "tensor_split": [1, 3]}],
        "qwen2-bias": [{"n_ctx": 512}, {"n_ctx": 512, "tensor_split": [3, 1]}],
        "llama-rope-freqs-tied": [{"n_ctx": 512}, {"n_ctx": 512, "n_gpu_layers": 2}],
        "gemma3-iswa": [{"n_ctx": 2048}, {"n_ctx": 1024, "tensor_split": [1, 2]}]}


@pytest.mark.parametrize("model", ["smollm2", "qwen3moe", "qwen3-untied", "qwen2-bias", "llama-rope-freqs-tied",
                                   "gemma3-iswa"])
def test_bytes_per_device_equal_llamacpp(two_workers, models, model):
    if model == "smollm2":
        cases = CASES + MORE[model]
    else:
        cases = MORE.get(model) or CASES[:2] + [{"n_ctx": 512, "n_gpu_layers": 3}]
    rows = reported(models[model], two_workers, cases)
    worst = 0
    for case, row in zip(cases, rows):
        sb = _predict(models[model], two_workers, case)
        got = row["buffers"]
        for d in sb.devices:
            model_b, kv_b, compute_b = got.get(d.name, [0, 0, 0])
            assert (d.weights, d.kv, d.compute) == (model_b, kv_b, compute_b), (model, case, d.name)
        host = {k: v for k, v in got.items() if not k.startswith("RPC")}
        assert sum(sb.host_weights.values()) == sum(v[0] for v in host.values()), (model, case, host)
        assert sb.host_kv == sum(v[1] for v in host.values()), (model, case)
        assert sb.host_compute == sum(v[2] for v in host.values()), (model, case)
        worst = max(worst, max(abs(d.total - sum(got.get(d.name, [0, 0, 0]))) for d in sb.devices))
    assert worst == 0


def test_default_split_follows_free_memory(two_workers, models):
    sb = _predict(models["smollm2"], two_workers, {"n_ctx": 512})
    assert sb.counts() == (16, 15)         # equal free memory: layers 0-15, then 16-29 and the output
    assert sb.devices[1].output and not sb.devices[0].output
    assert sb.pipeline


def _run(args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "localinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, check=False)


def test_greedy_output_equals_local(two_workers):
    common = ["run", "-p", "The capital of France is", "--raw", "-n", "16", "--temp", "0", "-t", "1", "-c", "512",
              "--json"]
    local = _run(common)
    split = _run(common + ["--rpc", ",".join(two_workers), "--tensor-split", "2,1"])
    assert local.returncode == 0, local.stderr
    assert split.returncode == 0, split.stderr
    a, b = json.loads(local.stdout), json.loads(split.stdout)
    assert b["text"] == a["text"] and len(b["text"]) > 10
    rows = {r["device"]: r for r in b["devices"]}
    for ep in two_workers:
        r = rows[f"RPC0[{ep}]"]
        for key in ("weights", "kv", "compute"):   # the log's MiB have two decimals
            assert abs(r["predicted"][key] - r["reported"][key]) <= 0.005 * (1 << 20) + 1


def test_default_split_follows_what_workers_report(models):
    gib = 1 << 30
    with workers(2, mem=[1 * gib, 3 * gib]) as ws:
        eps = [ep for _, ep in ws]
        assert [probe(ep).devices[0].free for ep in eps] == [gib, 3 * gib]     # worker --mem
        case = {"n_ctx": 512}
        sb = _predict(models["smollm2"], eps, case)
        got = reported(models["smollm2"], eps, [case])[0]["buffers"]
    assert sb.counts() == (8, 23)                      # 1:3 by free memory: 31 units → 8 and 23
    for d in sb.devices:
        assert (d.weights, d.kv, d.compute) == tuple(got[d.name])
