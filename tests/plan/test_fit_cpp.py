"""The port of llama.cpp's --fit (common/fit.cpp) step by step, on a tiny MoE skeleton with localinfer's memory
model of an RPC worker's device as the measure and targets taken from that measure; and, where scripts/build_llama_server.sh has built the
real llama-fit-params, the same flags as the tool over a `localinfer worker --mem` device."""

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.memory import FitRequest
from localinfer.backends.llamacpp.split import split_breakdown
from localinfer.backends.split import SplitDevice
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit_cpp import MARGIN, fit_cpp, parse_override, state_request

SPEC = {"n_layers": 8, "n_embd": 512, "n_head": 8, "n_head_kv": 2, "head_dim": 64, "n_ff": 0, "vocab_size": 1000,
        "context_length": 4096, "arch": "qwen3moe", "expert_ff": 1024, "n_expert": 32, "n_expert_used": 4,
        "type": "f16"}
REQ = FitRequest(n_ctx=2048)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit_cpp") / "moe.gguf"
    return ModelSpec.from_gguf(str(write_skeleton(SPEC, path)))


@pytest.fixture(scope="module")
def measure(model):
    """Device bytes on one RPC worker's CPU device (llama.cpp's dry run reads nothing, so no mmap)."""
    def on_worker(r):
        d = split_breakdown(model, (SplitDevice("RPC0", "cpu", 1 << 40, 1 << 40),), replace(r, mmap=False),
                            dry_run=True).devices[0]
        return d.weights + d.kv + d.compute
    return on_worker


def _full(model, k, overflow="moe"):
    """fit.cpp's state with every layer on the device and the experts of layers 0..k-1 there."""
    n = model.n_layers
    return state_request(model, REQ, n + 1, n + 1 - k, overflow)


def test_a_request_that_fits_is_left_alone(model, measure):
    c = fit_cpp(model, REQ, measure, measure(REQ))
    assert not c.changed and c.request == REQ and c.n_gpu_layers == -1


def test_whole_layers_front_to_back_then_up_then_gate_of_the_next(model, measure):
    n, k = model.n_layers, 3
    m = {f: measure(_full(model, k, f)) for f in ("moe", "up", "gate", "attn")}
    nxt = measure(_full(model, k + 1))
    assert m["attn"] < m["moe"] < m["up"] < m["gate"] < nxt
    c = fit_cpp(model, REQ, measure, m["gate"] + 1)
    assert (c.n_gpu_layers, c.n_full, c.partial, c.device_bytes) == (n + 1, k, "gate", m["gate"])
    # fit.cpp's -ot: one entry per layer from the first partial one, through the index after the last layer
    assert [parse_override(p) for p, _ in c.overrides] == [(k, "gate")] + [(il, "moe") for il in range(k + 1, n + 1)]
    assert c.on_host == n - k - 1
    assert fit_cpp(model, REQ, measure, m["up"] + 1).partial == "up"
    # the partial steps keep a part only strictly under the target
    assert fit_cpp(model, REQ, measure, m["gate"]).partial == "up"


def test_when_up_does_not_fit_the_next_layers_router_goes_to_the_cpu_too(model, measure):
    """fit.cpp's LAYER_FRACTION_ATTN: the first layer past the full ones keeps only its attention on the device,
    even where the whole layers meet the target exactly (the port before this kept the router there)."""
    n, k = model.n_layers, 3
    at = measure(_full(model, k))
    for target in (at, measure(_full(model, k, "up"))):
        c = fit_cpp(model, REQ, measure, target)
        assert (c.n_full, c.partial, c.on_host) == (k, "attn", n - k)
        assert c.overrides[0] == (rf"blk\.{k}\.ffn_(gate|up|gate_up|down).*", "CPU")
        assert c.device_bytes == measure(_full(model, k, "attn")) < at


def test_dense_only_layers_when_even_the_dense_part_does_not_fit(model, measure):
    n = model.n_layers
    dense_all = measure(state_request(model, REQ, n + 1, n))
    c = fit_cpp(model, REQ, measure, dense_all - 1)
    assert 0 < c.n_gpu_layers < n + 1 and c.device_bytes <= dense_all - 1
    assert c.n_gpu_layers + 1 > n + 1 or measure(state_request(model, REQ, c.n_gpu_layers + 1, c.n_gpu_layers)) \
        > dense_all - 1
    # the first offloaded layer keeps its experts (fit.cpp counts the output layer as its one full layer)
    first = n + 1 - c.n_gpu_layers
    assert [il for il, _ in map(parse_override, (p for p, _ in c.overrides))][0] == first + 1


def test_user_set_layers_or_overrides_are_left_to_the_user(model, measure):
    assert fit_cpp(model, replace(REQ, n_gpu_layers=4), measure, 1) is None
    assert fit_cpp(model, replace(REQ, n_cpu_moe=2), measure, 1) is None


def _tool() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    root = Path(os.environ.get("LOCALINFER_CACHE", Path.home() / ".cache/localinfer"))
    tool = root / f"llama-server-{llama_cpp.__version__}" / "build" / "bin" / "llama-fit-params"
    return str(tool) if os.access(tool, os.X_OK) else None


@pytest.mark.skipif(_tool() is None, reason="llama-fit-params not built (scripts/build_llama_server.sh llama-fit-params)")
@pytest.mark.parametrize("case", ["attn", "attn-at-up", "up", "gate", "dense-only"])
def test_the_real_llama_fit_params_chooses_the_same_flags(model, measure, case):
    """The device: a worker advertising a size chosen from localinfer's memory model of it (bytes equal to
    llama.cpp's: tests/backends/test_rpc_moe_offload.py), so that the tool lands on each kind of partial layer,
    or lowers -ngl; the tool and the port must print the same -ngl and the same -ot list."""
    from benchmarks.moe_fit_params_rpc import parse_fit, start_worker, stop_worker, tool_args

    n, k = model.n_layers, 4
    target = {"attn": measure(_full(model, k)),                  # whole layers meet it exactly
              "attn-at-up": measure(_full(model, k, "up")),      # up meets it exactly: not strictly under
              "up": measure(_full(model, k, "up")) + 1,
              "gate": measure(_full(model, k, "gate")) + 1,
              "dense-only": measure(state_request(model, REQ, n + 1, n)) - 1}[case]
    proc, ep = start_worker(target + MARGIN)
    try:
        out = subprocess.run([_tool(), *tool_args(model.path, ep, REQ)], capture_output=True, text=True,
                             timeout=300, check=True).stdout
    finally:
        stop_worker(proc)
    port = fit_cpp(model, REQ, measure, target)
    assert parse_fit(out) == (port.n_gpu_layers, port.overrides)
    if case == "dense-only":
        assert port.n_gpu_layers < n + 1
    else:
        assert port.n_full == k and port.partial == case.split("-")[0]
