"""The compute buffers of one device and its host when buffer overrides keep weights in host memory.

llama.cpp's scheduler (ggml-backend.cpp ``ggml_backend_sched_split_graph``) runs an op on its weight's
backend; a weight in a host buffer is instead handed to the first device whose ``offload_op`` asks for the
op ("1.off": ggml-cuda for every op of a batch of 32 tokens or more, ggml-metal for MUL_MAT/MUL_MAT_ID of
32 or more), which copies the weight into its compute buffer, one split per such weight so that the copies
reuse one another's memory.  CPU_REPACK is not a host buffer: repacked experts always run on the CPU.  The
device and host buffers come from replaying all of it (:func:`.split_compute.split_compute` with the device
and the host as its two backends); nothing is pipelined (llama-context.cpp: no pipeline parallelism with
tensor overrides).
"""

from __future__ import annotations

from localinfer.backends.llamacpp.placement import device_buffer, gpu_layer_start, offloaded_units, output_on_gpu
from localinfer.backends.llamacpp.split_compute import split_compute
from localinfer.backends.llamacpp.tensor_homes import HOST, expert_home, tensor_homes
from localinfer.model.spec import ModelSpec


def overridden_compute(spec: ModelSpec, kind: str, req, overrides, cells, graphs,
                       cpu_features: tuple[str, ...] = ()) -> tuple[int, int, str]:
    """(device bytes, host bytes, formula) of the compute buffers for ``req`` on one device of ``kind``."""
    n = spec.n_layers
    start = gpu_layer_start(n, req.n_gpu_layers)
    out_gpu = output_on_gpu(n, req.n_gpu_layers)

    def on_device(unit) -> int:
        if unit == "in":
            return HOST
        if unit == "out":
            return 0 if out_gpu else HOST
        return 0 if unit >= start else HOST

    homes = tensor_homes(spec, on_device, overrides, {device_buffer(kind): 0},
                         cpu_features if req.repack else ())
    full = len(offloaded_units(n, req.n_gpu_layers)) > n
    sizes = [split_compute(spec, lambda u: 1 if on_device(u) == HOST else 0, [kind], n_kv=cells.cells_base,
                           n_ubatch=tokens, n_outputs=rows, flash_attn=req.flash_attn_on, n_kv_swa=cells.cells_swa,
                           type_k=req.type_k, type_v=req.type_v, pin_norms=full, tensor_home=expert_home(homes, 1))
             for tokens, rows in graphs]
    dev, host = (max(s[i] for s in sizes) for i in (0, 1))
    moved = sum(1 for h in homes if h.backend == HOST and "_exps." in h.tensor.name)
    copies = kind in ("cuda", "metal") and graphs[0][0] >= 32
    copied = "; the device copies each host-buffer expert matrix up for its split" if copies else ""
    formula = (f"ggml scheduler and graph allocator replayed over the {spec.arch} graph with {moved} expert "
               f"tensors in host memory: ubatch {graphs[0][0]} tokens, {cells.cells_base} KV cells{copied}")
    others = [h.tensor.nbytes for h in homes if copies and h.backend == HOST and not h.repacked and h.tensor.matmul
              and "_exps." not in h.tensor.name and not h.tensor.name.startswith("token_embd")]
    if others:          # the replay names only the expert matrices: a host layer's other weights are copied too
        dev += max(others)
        formula += (f" + the largest other host-layer weight ({max(others)} B) copied up for batched matmuls "
                    "(an estimate: the replay does not name it)")
    return dev, host, formula
