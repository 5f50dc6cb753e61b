"""`-ngl N` places what llama.cpp places: a loopback RPC worker (1 thread) stands in for an accelerator, so
llama.cpp's own choice of offloaded layers shows in the bytes it allocates there and in the host's mapping.

llama.cpp counts the output layer among the offloadable units (n_layer + 1 of them; ``i_gpu_start =
n_layer + 1 - ngl``): -ngl 1 offloads the output layer alone, -ngl n_layer all blocks but the first.  The
single-device placement (``fit --gpu-layers``) and the split share that rule (``offloaded_units``)."""

import pytest

from tests.backends.test_rpc_split import _predict
from tests.support.rpc_workers import reported, workers

pytest.importorskip("llama_cpp")

from gguf import GGMLQuantizationType

from localinfer.backends.llamacpp.placement import gpu_layer_start, output_on_gpu, weight_placement
from localinfer.backends.llamacpp.rpc_probe import probe
from localinfer.model.sources import resolve_model
from localinfer.model.spec import ModelSpec
from localinfer.plan.split_devices import from_workers
from tests.support.ggufgen import write_tiny_model


@pytest.fixture(scope="module")
def worker():
    with workers(1) as [(_, ep)]:
        yield ep


@pytest.mark.parametrize("model", ["smollm2", "llama-rope-freqs-tied"])
def test_ngl_offloads_what_llamacpp_offloads(worker, model, tmp_path):
    path = str(resolve_model(None)) if model == "smollm2" else str(
        write_tiny_model(tmp_path / "rope.gguf", arch="llama", n_layers=4, qtype=GGMLQuantizationType.Q4_0,
                         rope_freqs=True, tied=True))
    spec = ModelSpec.from_gguf(path)
    n = spec.n_layers
    feats = from_workers([probe(worker)]).host.cpu_features
    ngls = [0, 1, 2, n - 1, n, n + 1, -1]
    rows = reported(path, [worker], [{"n_ctx": 512, "n_gpu_layers": g} for g in ngls])
    for ngl, row in zip(ngls, rows):
        got = row["buffers"]
        remote = got.get(f"RPC0[{worker}]", [0, 0, 0])
        host_model = sum(v[0] for k, v in got.items() if not k.startswith("RPC"))
        start, out = gpu_layer_start(n, ngl), output_on_gpu(n, ngl)
        assert out == (ngl != 0) and start == (n if ngl in (0, 1) else 0 if ngl in (n + 1, -1) else n + 1 - ngl)
        # the split: the worker's layers, output layer, and every byte there
        sb = _predict(path, [worker], {"n_ctx": 512, "n_gpu_layers": ngl})
        d = sb.devices[0]
        assert (d.layers, d.output) == (tuple(range(start, n)), out), (model, ngl)
        assert (d.weights, d.kv, d.compute) == tuple(remote), (model, ngl)
        # one device: the placement fit --gpu-layers uses.  An RPC worker's CPU buffer copies each tensor padded
        # to 32 bytes, as a Metal buffer without mmap does; the host keeps the rest mapped (and repacked)
        copied = weight_placement(spec, "metal", ngl, mmap=False)
        mapped = weight_placement(spec, "cuda", ngl, cpu_features=feats)
        assert (copied.n_gpu_layers, copied.output_on_device) == (n - start, out), (model, ngl)
        assert copied.device_bytes == remote[0], (model, ngl)
        assert mapped.host_bytes == host_model, (model, ngl)
