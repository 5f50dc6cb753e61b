"""fit.cpp's automatic context (step 2) and its split over several devices, through the port's public functions.

Each case is one of benchmarks/results/fit_params_devices.txt: the real llama-fit-params over `localinfer worker
--mem` devices of these sizes printed the line asserted here.  The port reproduces it from localinfer's memory
model of the same devices (RPC workers' CPU devices, sizes exact), with no worker and no llama.cpp."""

from dataclasses import replace

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.llamacpp.split import split_breakdown
from localinfer.backends.memory import FitRequest
from localinfer.backends.split import SplitDevice
from localinfer.model.spec import ModelSpec
from localinfer.plan.fit_cpp import FULL_CTX, MARGIN, N_CTX_MIN, fit_cpp, fit_cpp_devices, fit_cpp_split
from localinfer.plan.fit_cpp_steps import entries

MiB = 1 << 20


def ot(*ents) -> str:
    """The tool's -ot list of (layer, fraction, buffer) entries; a range of layers for "moe" entries on the CPU."""
    flat = []
    for e in ents:
        flat += [(il, "moe", "CPU") for il in e] if isinstance(e, range) else [e]
    return ' -ot "' + ",".join(f"{p}={b}" for p, b in entries(flat)) + '"'


EP2, EP3 = "RPC0[EP2]", "RPC0[EP3]"
# (preset, file type, MiB of each worker, -c: None not given, 0 explicit[, -np]) -> the real tool's line
CASES = {
    "ctx lowered, fits": (("llama-3.1-8b", "q4_k_m", (12288,), None), "-c 52736 -ngl -1"),
    "explicit -c 0: full context": (("llama-3.1-8b", "q4_k_m", (12288,), 0), "-c 131072 -ngl 17"),
    "ctx at its minimum, dense": (("llama-3.1-70b", "q4_k_m", (24576,), None), "-c 4096 -ngl 45"),
    "ctx at its minimum, MoE": (("qwen3-30b-a3b", "q4_k_m", (16384,), None),
                                "-c 4096 -ngl 49" + ot((40, "attn", "CPU"), range(41, 49))),
    "2 devices, dense": (("qwen3-14b", "q4_k_m", (4096, 6144), 4096), "-c 4096 -ngl 35 -ts 14,21"),
    "2 devices, MoE": (("qwen3-30b-a3b", "q4_k_m", (10240, 8192), 4096),
                       "-c 4096 -ngl 49 -ts 25,24" + ot((24, "gate", EP2), (42, "gate", "CPU"), range(43, 49))),
    "2 devices, dense, ctx lowered": (("llama-3.1-8b", "q4_k_m", (6144, 8192), None), "-c 54272 -ngl 33 -ts 13,20"),
    "2 devices, MoE, ctx lowered": (("qwen3-30b-a3b", "q4_k_m", (12288, 10240), None),
                                    "-c 23040 -ngl 49 -ts 28,21" + ot((27, "up", EP2))),
    "2 devices, MoE, room in total": (("qwen3-30b-a3b", "q4_k_m", (16384, 8192), None),
                                      "-c 40960 -ngl 49 -ts 35,14" + ot((34, "gate", EP2))),
    "3 devices, MoE": (("gpt-oss-120b", "mxfp4_moe", (24576, 16384, 12288), 4096),
                       "-c 4096 -ngl 37 -ts 15,9,13"
                       + ot((14, "attn", EP2), (23, "attn", EP3), (29, "attn", "CPU"), range(30, 37))),
    "ctx lowered, 2 sequences": (("llama-3.1-8b", "q4_k_m", (12288,), None, 2), "-c 52736 -ngl -1"),
    "2 devices, MoE, ctx lowered, 2 sequences": (("qwen3-30b-a3b", "q4_k_m", (12288, 10240), None, 2),
                                                 "-c 23552 -ngl 49 -ts 28,21" + ot((27, "up", EP2))),
    # the user's -ts (the tool prints it back where the request fits as it is, and gives up otherwise: "tensor_split
    # already set by user, abort", even where step 2's lower context would fit)
    "2 devices, a user -ts that fits": (("qwen3-14b", "q4_k_m", (6144, 8192), 4096, 1, (3, 4)),
                                        "-c 4096 -ngl -1 -ts 3,4"),
    "2 devices, a user -ts over a device": (("qwen3-14b", "q4_k_m", (4096, 6144), 4096, 1, (1, 1)), None),
    "2 devices, a user -ts, ctx auto": (("llama-3.1-8b", "q4_k_m", (6144, 8192), None, 1, (1, 1)), None),
    # the tool prints each share cast to an unsigned integer
    "2 devices, a fractional user -ts": (("qwen3-14b", "q4_k_m", (6144, 8192), 4096, 1, (0.4, 0.6)),
                                         "-c 4096 -ngl -1 -ts 0,0"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fit_cpp_devices")
    cache = {}

    def get(preset, qtype):
        if (preset, qtype) not in cache:
            path = write_skeleton(preset, folder / f"{preset}-{qtype}.gguf", type=qtype)
            cache[preset, qtype] = ModelSpec.from_gguf(str(path))
        return cache[preset, qtype]
    return get


def _workers(mems):
    return tuple(SplitDevice(f"RPC0[EP{i + 1}]", "cpu", m * MiB, m * MiB) for i, m in enumerate(mems))


def _measure(spec, devs):
    """(total, weights) of each device as llama.cpp's dry run sizes them (nothing read: no mmap)."""
    def measure(r, shares):
        sb = split_breakdown(spec, devs, replace(r, mmap=False), shares, dry_run=True)
        return [(d.weights + d.kv + d.compute, d.weights) for d in sb.devices]
    return measure


def _fit(spec, mems, ctx, n_seq=1, ts=None):
    return fit_cpp_split(spec, _workers(mems), FitRequest(n_ctx=ctx or N_CTX_MIN, n_seq=n_seq), ctx_auto=not ctx,
                         n_ctx_min=FULL_CTX if ctx == 0 else N_CTX_MIN, shares=ts)


@pytest.mark.parametrize("case", list(CASES))
def test_the_port_prints_the_real_tools_line(models, case):
    (preset, qtype, mems, *how), line = CASES[case]
    spec = models(preset, qtype)
    choice = _fit(spec, mems, *how)
    if line is None:
        assert choice is None
        return
    assert choice is not None and choice.line() == line
    within = [u <= m * MiB - MARGIN for u, m in zip(choice.used, mems)]
    if case == "2 devices, dense, ctx lowered":
        # fit.cpp fills the last device first, while the model is not fully offloaded; device 0's layers then
        # complete it, pipeline parallelism comes on and the last device's compute buffer grows past its target
        # (--fit-print of the tool's own plan: RPC1 2773 + 4028 + 534 MiB against 7168)
        assert within == [True, False]
    else:
        assert all(within)


def test_the_context_is_lowered_by_interpolation_and_nothing_else_changes(models):
    spec = models("llama-3.1-8b", "q4_k_m")
    c = _fit(spec, (12288,), None)
    assert c.ctx_reduced and c.changed and c.n_ctx == 52736 and c.n_ctx % 256 == 0
    assert (c.n_gpu_layers, c.overrides, c.request.llama_n_ctx) == (-1, (), 52736)
    # at the train context it is over the target; llama.cpp's explicit -c 0 keeps that context and drops layers
    full = _fit(spec, (12288,), 0)
    assert not full.ctx_reduced and full.n_ctx == spec.n_ctx_train and full.n_gpu_layers < spec.n_layers + 1


def test_a_set_context_is_never_lowered(models):
    spec = models("llama-3.1-8b", "q4_k_m")
    c = _fit(spec, (6144,), 32768)
    assert c.n_ctx == 32768 and not c.ctx_reduced and 0 < c.n_gpu_layers < spec.n_layers + 1


def test_one_device_wrapper_is_the_same_decision(models):
    spec = models("qwen3-30b-a3b", "q4_k_m")
    devs = _workers((16384,))
    m = _measure(spec, devs)
    one = fit_cpp(spec, FitRequest(), lambda r: m(r, None)[0][0], devs[0].free - MARGIN, ctx_auto=True)
    assert one.line() == CASES["ctx at its minimum, MoE"][1] and one.on_host == 8 and one.partial == "attn"


def test_several_devices_need_a_buffer_name_each(models):
    spec = models("qwen3-14b", "q4_k_m")
    from localinfer.errors import UsageError
    with pytest.raises(UsageError):
        fit_cpp_devices(spec, FitRequest(), lambda r, s: [(0, 0)], [1, 1], ["RPC0[EP1]"])
