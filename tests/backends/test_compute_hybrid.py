"""The hybrid recurrent graphs' compute buffer (graph_hybrid) against llama.cpp's CPU dry run, to the byte.

Tiny random-weight files of each hybrid family are written here (the layouts tests' TINY specs, and mamba,
lfm2moe and nemotron_h_moe files, which the layouts do not write); one subprocess runs llama.cpp's no-alloc dry run over all of them (``benchmarks.fit_accuracy.probe``) and the
predicted compute buffer must equal llama.cpp's for flash attention on and off, one and four sequences,
f16 and q8_0 keys; split across two loopback RPC workers, every device's bytes must too.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fit_accuracy import Case, probe
from localinfer.errors import DryRunError
from localinfer.backends.llamacpp.compute_buffer import graph_builder
from localinfer.backends.llamacpp.memory import breakdown
from localinfer.backends.memory import FitRequest
from localinfer.devices.profiles import local_device
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import add_byte_level_vocab

pytest.importorskip("llama_cpp")


def _tiny_specs() -> dict:
    """The layouts tests' TINY specs, or none where this branch lacks the hybrid layouts."""
    try:
        import gguf_tools.layouts.hybrid  # noqa: F401

        from tests.gguf_tools.test_layouts_hybrid import TINY
    except ImportError:
        return {}
    return TINY


TINY = _tiny_specs()
NO_LAYOUTS = "gguf_tools.layouts.hybrid (and its TINY specs) is not in this branch: it comes with the hybrid layouts"


def _write(path, arch: str, kv: dict, tensors: dict):
    """A small random-weight GGUF: ``kv`` under ``{arch}.``, ``tensors`` name -> ne (GGUF order), a byte-level
    vocabulary (for the architectures the layouts do not write)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    n_vocab = add_byte_level_vocab(w, add_bos=None)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (64, n_vocab), **tensors}
    for name, ne in tensors.items():
        w.add_tensor(name, (rng.standard_normal(tuple(reversed(ne))) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


E = 64
_BASE = {"context_length": 4096, "embedding_length": E, "block_count": 4, "attention.layer_norm_rms_epsilon": 1e-5}
_ATTN = {"attn_norm.weight": (E,), "attn_q.weight": (E, 64), "attn_k.weight": (E, 32), "attn_v.weight": (E, 32),
         "attn_output.weight": (64, E)}


def _mamba(path):
    """Mamba-1 (llama-model.cpp LLM_ARCH_MAMBA's tensors): d_inner 128, d_state 16, dt_rank 4."""
    layer = {"attn_norm.weight": (E,), "ssm_in.weight": (E, 256), "ssm_conv1d.weight": (4, 128),
             "ssm_conv1d.bias": (128,), "ssm_x.weight": (128, 36), "ssm_dt.weight": (4, 128), "ssm_dt.bias": (128,),
             "ssm_a": (16, 128), "ssm_d": (128,), "ssm_out.weight": (128, E)}
    kv = {**_BASE, "feed_forward_length": 0, "attention.head_count": 0, "ssm.conv_kernel": 4, "ssm.inner_size": 128,
          "ssm.state_size": 16, "ssm.time_step_rank": 4}
    return _write(path, "mamba", kv, {"output_norm.weight": (E,), "output.weight": (E, 259),
                                      **{f"blk.{il}.{k}": ne for il in range(4) for k, ne in layer.items()}})


def _moe(ff_in: int, gated: bool) -> dict:
    t = {"ffn_gate_inp.weight": (E, 4), "exp_probs_b.bias": (4,), "ffn_up_exps.weight": (ff_in, 32, 4),
         "ffn_down_exps.weight": (32, ff_in, 4)}
    return {**t, "ffn_gate_exps.weight": (ff_in, 32, 4)} if gated else t


def _lfm2moe(path):
    """lfm2moe (lfm2moe.cpp): conv, conv, attention, conv; layer 0 dense, then sigmoid-gated experts."""
    conv = {"attn_norm.weight": (E,), "shortconv.conv.weight": (3, E), "shortconv.in_proj.weight": (E, 3 * E),
            "shortconv.out_proj.weight": (E, E)}
    attn = {**_ATTN, "attn_q.weight": (E, E), "attn_output.weight": (E, E), "attn_q_norm.weight": (16,),
            "attn_k_norm.weight": (16,)}
    dense = {"ffn_gate.weight": (E, 128), "ffn_up.weight": (E, 128), "ffn_down.weight": (128, E)}
    tensors = {"token_embd_norm.weight": (E,)}
    for il in range(4):
        block = {**(attn if il == 2 else conv), "ffn_norm.weight": (E,), **(dense if il == 0 else _moe(E, True))}
        tensors.update({f"blk.{il}.{k}": ne for k, ne in block.items()})
    kv = {**_BASE, "feed_forward_length": 128, "attention.head_count": 4, "attention.head_count_kv": [0, 0, 2, 0],
          "attention.key_length": 16, "attention.value_length": 16, "rope.dimension_count": 16,
          "rope.freq_base": 10000.0, "shortconv.l_cache": 3, "expert_count": 4, "expert_used_count": 2,
          "expert_feed_forward_length": 32, "leading_dense_block_count": 1, "expert_gating_func": 2}
    return _write(path, "lfm2moe", kv, tensors)


def _nemotron_h_moe(path):
    """nemotron_h_moe (nemotron-h.cpp): Mamba-2, latent MoE, attention, latent MoE."""
    mamba = {"attn_norm.weight": (E,), "ssm_in.weight": (E, 328), "ssm_conv1d.weight": (4, 192),
             "ssm_conv1d.bias": (192,), "ssm_dt.bias": (8,), "ssm_a": (1, 8), "ssm_d": (1, 8),
             "ssm_norm.weight": (64, 2), "ssm_out.weight": (128, E)}
    moe = {"attn_norm.weight": (E,), **_moe(32, False), "ffn_latent_down.weight": (E, 32),
           "ffn_latent_up.weight": (32, E), "ffn_up_shexp.weight": (E, 64), "ffn_down_shexp.weight": (64, E)}
    tensors = {"output_norm.weight": (E,), "output.weight": (E, 259)}
    for il, block in enumerate((mamba, moe, _ATTN, moe)):
        tensors.update({f"blk.{il}.{k}": ne for k, ne in block.items()})
    kv = {**_BASE, "feed_forward_length": [0, 128, 0, 128], "attention.head_count": 4,
          "attention.head_count_kv": [0, 0, 2, 0], "attention.key_length": 16, "attention.value_length": 16,
          "attention.layer_norm_epsilon": 1e-5, "ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16,
          "ssm.time_step_rank": 8, "ssm.group_count": 2, "expert_count": 4, "expert_used_count": 2,
          "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 64, "expert_weights_norm": True,
          "expert_weights_scale": 2.5, "moe_latent_size": 32}
    return _write(path, "nemotron_h_moe", kv, tensors)


def _legacy_qwen3next(src, dst):
    """``src`` (qwen3next) rewritten as the legacy files were: one ssm_in per linear layer for attn_qkv and
    attn_gate (q | k | v | z per key head)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "qwen3next")
    adders = {GGUFValueType.FLOAT32: w.add_float32, GGUFValueType.STRING: w.add_string,
              GGUFValueType.BOOL: w.add_bool, GGUFValueType.INT32: w.add_int32, GGUFValueType.ARRAY: w.add_array}
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            adders.get(f.types[0], lambda k, v: w.add_uint32(k, int(v)))(f.name, f.contents())
    for t in r.tensors:
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind == "attn_gate":
            continue
        data = np.array(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        if kind == "attn_qkv":
            gate = r.get_tensor([x.name for x in r.tensors].index(t.name.replace("attn_qkv", "attn_gate")))
            data = np.concatenate([data, np.array(gate.data, dtype=np.float32)], axis=0)
        w.add_tensor(t.name.replace("attn_qkv", "ssm_in"), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


HANDMADE = {"mamba": _mamba, "lfm2moe": _lfm2moe, "nemotron_h_moe": _nemotron_h_moe}


ARCHS = ("qwen35", "qwen35moe", "qwen3next", "granitehybrid", "granitehybrid-moe", "nemotron_h", "lfm2", "mamba2",
         "qwen35-mtp", "qwen3next-mtp", *HANDMADE)
CHECKED = (*ARCHS, "qwen3next-legacy")
CASES = [Case("512 fa", "tiny", 512, flash_attn=True),
         Case("2048 np=4 fa", "tiny", 2048, n_seq=4, flash_attn=True),
         Case("1024 np=4 no-fa", "tiny", 1024, n_seq=4, flash_attn=False),
         Case("4096 no-fa", "tiny", 4096, flash_attn=False)]
Q8_CASES = [Case("2048 q8_0 fa", "tiny", 2048, type_k="q8_0", type_v="q8_0", flash_attn=True)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{(arch, case name): (llama.cpp's compute buffer, predicted)} from one dry-run subprocess."""
    root = tmp_path_factory.mktemp("hybrid")
    paths = {name: str(write(root / f"{name}.gguf")) for name, write in HANDMADE.items()}
    unwritable: dict[str, str] = {}
    if TINY:
        from tests.support.ggufgen import write_tiny_arch

        for name in ARCHS:
            if name in TINY:
                try:
                    paths[name] = str(write_tiny_arch(root / f"{name}.gguf", TINY[name]))
                except ValueError as exc:           # the layouts' own tests report a spec they cannot write
                    unwritable[name] = str(exc)
        if "qwen3next" in paths:
            paths["qwen3next-legacy"] = str(_legacy_qwen3next(paths["qwen3next"], root / "legacy.gguf"))
    jobs = [(p, CASES + (Q8_CASES if name.startswith("qwen3") else [])) for name, p in paths.items()]
    out = {}
    for (name, path), (_, cases), rows in zip(paths.items(), jobs, probe(jobs, timeout=300)):
        spec = ModelSpec.from_gguf(path)
        for case, row in zip(cases, rows):
            if isinstance(row, DryRunError):
                out[name, case.name] = (None, str(row))
                continue
            req = FitRequest(n_ctx=case.n_ctx, n_seq=case.n_seq, flash_attn=case.flash_attn, mmap=False,
                             type_k=case.type_k, type_v=case.type_v)
            predicted = breakdown(spec, local_device(), req)[0].compute
            out[name, case.name] = (sum(b.compute for b in row.buffers), predicted)
    out.update({(name, None): (None, reason) for name, reason in unwritable.items()})
    return out


@pytest.mark.parametrize("name", CHECKED)
def test_hybrid_compute_buffer_matches_llama_cpp(measured, name):
    if (name, None) in measured:
        pytest.skip(f"the layouts cannot write TINY[{name!r}]: {measured[name, None][1]}")
    rows = {case: v for (arch, case), v in measured.items() if arch == name}
    if not rows:
        pytest.skip(NO_LAYOUTS if not TINY else f"no TINY spec for {name}")
    for case, (llama, ours) in rows.items():
        assert llama is not None, f"{name} {case}: llama.cpp's dry run failed: {ours}"
        assert ours == llama, f"{name} {case}: predicted {ours} B, llama.cpp {llama} B ({ours / llama:.4f})"


@pytest.mark.parametrize("name", ARCHS)
def test_hybrid_graph_is_verified(tmp_path, name):
    if name in HANDMADE:
        path = HANDMADE[name](tmp_path / "x.gguf")
    elif name in TINY:
        from tests.support.ggufgen import write_tiny_arch

        try:
            path = write_tiny_arch(tmp_path / "x.gguf", TINY[name])
        except ValueError as exc:
            pytest.skip(f"the layouts cannot write TINY[{name!r}]: {exc}")
    else:
        pytest.skip(NO_LAYOUTS if not TINY else f"no TINY spec for {name}")
    spec = ModelSpec.from_gguf(str(path))
    _, layers, verified = graph_builder(spec)
    assert verified and layers == tuple(range(spec.n_layers))


SPLIT_CASES = [{"n_ctx": 512}, {"n_ctx": 1024, "n_seq": 2, "flash_attn": False, "tensor_split": [1, 3]}]


@pytest.mark.parametrize("name", ["mamba", "lfm2moe", "nemotron_h_moe"])
def test_split_across_rpc_workers_equals_llama_cpp(tmp_path, name):
    """Two loopback RPC workers: each device's weights, KV + recurrent state and compute buffer (the scheduler
    replayed over the hybrid graph) equal llama.cpp's."""
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.llamacpp.rpc_probe import probe as probe_worker
    from localinfer.backends.llamacpp.split import split_breakdown
    from localinfer.commands._common import plan_request
    from localinfer.plan.split_devices import from_workers
    from tests.support.rpc_workers import reported, workers

    path = str(HANDMADE[name](tmp_path / f"{name}.gguf"))
    spec = ModelSpec.from_gguf(path)
    with workers(2) as ws:
        endpoints = [ep for _, ep in ws]
        rows = reported(path, endpoints, SPLIT_CASES)
        setup = from_workers([probe_worker(ep) for ep in endpoints])
        for case, row in zip(SPLIT_CASES, rows):
            plan = LoadPlan(path, n_ctx=case["n_ctx"], n_seq=case.get("n_seq", 1),
                            flash_attn=case.get("flash_attn"))
            sb = split_breakdown(spec, setup.devices, plan_request(spec, plan), case.get("tensor_split"),
                                 cpu_features=setup.host.cpu_features)
            got = row["buffers"]
            for d in sb.devices:
                assert (d.weights, d.kv, d.compute) == tuple(got.get(d.name, [0, 0, 0])), (name, case, d.name)
            host = [v for k, v in got.items() if not k.startswith("RPC")]
            assert (sb.host_kv, sb.host_compute) == (sum(v[1] for v in host), sum(v[2] for v in host)), (name, case)
