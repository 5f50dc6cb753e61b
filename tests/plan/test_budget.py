"""The budgeter's pure functions: llama.cpp cells, KV per backend, placement, output, compute replay."""

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.backends.llamacpp.compute_buffer import attn_rotation, compute_estimate
from localinfer.backends.llamacpp.memory import llama_cells, output_bytes
from localinfer.backends.llamacpp.placement import gpu_layer_start, output_on_gpu, repackable, weight_placement
from localinfer.backends.mlx.memory import mlx_bytes_per_token, mlx_capacity
from localinfer.errors import UsageError
from localinfer.model.kv import kv_bytes_per_token, row_bytes
from localinfer.model.spec import ModelSpec
from localinfer.plan.memory import kv_bytes
from localinfer.plan.paging import blocks_for, page_usage, shared_prefix_kv, tokens_held

TINY = dict(arch="qwen3", n_layers=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, vocab_size=1000,
            context_length=4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ModelSpec.from_gguf(write_skeleton(dict(TINY, type="q4_0"), tmp_path_factory.mktemp("b") / "t.gguf"))


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory):
    return ModelSpec.from_gguf(write_skeleton(dict(TINY, type="f16"), tmp_path_factory.mktemp("b") / "f.gguf"))


# ---- llama.cpp cells (rules observed in llama.cpp's own logs, see test_fit_llamacpp) ------------

@pytest.mark.parametrize("n_ctx, n_seq, unified, total, per_seq, streams", [
    (1000, 1, False, 1024, 1024, 1),       # padded to 256
    (1000, 3, False, 1536, 512, 3),        # pad(1024 // 3 = 341, 256) = 512 per sequence
    (1000, 3, True, 1024, 1024, 1),        # one shared stream
    (3000, 4, False, 3072, 768, 4),
    (8192, 1, False, 8192, 8192, 1),
])
def test_llama_cells(n_ctx, n_seq, unified, total, per_seq, streams):
    c = llama_cells(None, n_ctx, n_seq, kv_unified=unified)
    assert (c.n_ctx, c.n_ctx_seq, c.n_stream) == (total, per_seq, streams)


def test_bad_context_is_a_usage_error():
    with pytest.raises(UsageError):
        llama_cells(None, 0)


# ---- KV bytes ---------------------------------------------------------------------------

def test_row_bytes_gguf_blocks():
    assert row_bytes("q8_0", 32) == 34 and row_bytes("q4_0", 32) == 18 and row_bytes("f16", 32) == 64
    with pytest.raises(UsageError):
        row_bytes("q4_0", 48)


def test_kv_per_token_separate_types(tiny):
    rows = 4 * 2 * 64          # layers × kv heads × head dim
    assert kv_bytes_per_token(tiny) == 2 * rows * 2
    assert kv_bytes_per_token(tiny, "q8_0", "f16") == rows // 32 * 34 + rows * 2
    with pytest.raises(UsageError) as ei:
        kv_bytes_per_token(tiny, "q3_x")
    assert ei.value.flag == "-ctk"


def test_llama_cpp_kv_pads_cells(tiny):
    per_token = kv_bytes_per_token(tiny)
    assert kv_bytes(tiny, 1000) == 1024 * per_token
    assert kv_bytes(tiny, 1000, n_seq=3) == 3072 * per_token    # -c 3000 -np 3: 1024 cells each


def test_torch_kv_blocks(tiny):
    per_token = kv_bytes_per_token(tiny, "q8_0", "q8_0")
    assert kv_bytes(tiny, 17, "q8_0", "q8_0", backend="torch") == 32 * per_token
    assert kv_bytes(tiny, 16, backend="torch", n_seq=3) == 3 * 16 * kv_bytes_per_token(tiny)
    assert kv_bytes(tiny, 0, backend="torch") == 0


def test_mlx_layouts(tiny):
    per_head = 64
    assert mlx_bytes_per_token(tiny) == 4 * 2 * 2 * per_head * 2
    # 8 bits: 64 B codes + one scale and one bias (fp16) per 64 values, for K and V
    assert mlx_bytes_per_token(tiny, "q8_0", "q8_0") == 4 * 2 * 2 * (64 + 2 * 2)
    assert mlx_bytes_per_token(tiny, "q4_0", "q4_0", dtype="bf16") == 4 * 2 * 2 * (32 + 2 * 2)
    assert kv_bytes(tiny, 300, backend="mlx") == 512 * mlx_bytes_per_token(tiny)
    with pytest.raises(UsageError):
        mlx_bytes_per_token(tiny, "iq4_nl")


@pytest.mark.parametrize("updates, cap", [([300], 512), ([256, 1], 512), ([300, 1, 1, 300], 814),
                                          ([512, 512], 1024), ([1] * 257, 512), ([2048, 1], 2304)])
def test_mlx_growth_matches_mlx_lm(updates, cap):
    assert mlx_capacity(updates) == cap


def test_unknown_backend(tiny):
    with pytest.raises(UsageError) as ei:
        kv_bytes(tiny, 10, backend="vllm")
    assert ei.value.flag == "--backend"


# ---- requests, prefixes, pages ------------------------------------------------------------

def test_tokens_held_and_blocks():
    assert tokens_held(10, 1) == 10 and tokens_held(10, 5) == 14 and tokens_held(10, 0) == 10
    assert blocks_for(16) == 1 and blocks_for(17) == 2


def test_shared_prefix_partial_block_is_private(tiny):
    s = shared_prefix_kv(tiny, 20, 40, 2)
    per_token = kv_bytes_per_token(tiny)
    assert s.prefix_bytes == 16 * per_token and s.private_bytes == 32 * per_token
    with pytest.raises(UsageError):
        shared_prefix_kv(tiny, 50, 40)


def test_page_usage_sharing():
    u = page_usage([10, 10], 4, shared_prefix=8)
    assert u.blocks == 6 and u.physical_blocks == 4 and u.unused == 4


# ---- output buffer ----------------------------------------------------------------------

def test_output_buffer(tiny):
    assert output_bytes(tiny) == 1000 * 4
    assert output_bytes(tiny, n_seq=3) == 3 * 4000 and output_bytes(tiny, 1, n_outputs=9) == 9 * 4000


# ---- weight placement ---------------------------------------------------------------------

def test_layer_split_rules():
    """-ngl N offloads the last N of the 37 units (36 blocks, then the output layer): llama-model.cpp's
    i_gpu_start = n_layer + 1 - N; tests/backends/test_rpc_ngl.py checks it against llama.cpp's allocations."""
    assert gpu_layer_start(36, -1) == 0 and gpu_layer_start(36, 10) == 27 and gpu_layer_start(36, 99) == 0
    assert gpu_layer_start(36, 36) == 1 and gpu_layer_start(36, 37) == 0
    assert gpu_layer_start(36, 1) == 36 and gpu_layer_start(36, 0) == 36          # no block offloaded
    assert output_on_gpu(36, 1) and output_on_gpu(36, 36) and output_on_gpu(36, -1) and not output_on_gpu(36, 0)


def test_repack_rules():
    assert repackable("Q4_0", (256, 512), ("avx2",))
    assert not repackable("Q4_0", (256, 12), ("avx2",))
    assert not repackable("Q8_0", (256, 512), ("avx2",))
    assert repackable("Q2_K", (256, 512), ("avx2", "avx512")) and not repackable("Q2_K", (256, 512), ("avx2",))
    assert not repackable("Q4_0", (256,), ("avx2",))


def test_cpu_placement_maps_the_file_and_repacks(tiny):
    plain = weight_placement(tiny, "cpu")
    assert plain.buffers == {"CPU_Mapped model": plain.buffers["CPU_Mapped model"]}
    assert plain.buffers["CPU_Mapped model"] >= tiny.weight_bytes
    rep = weight_placement(tiny, "cpu", cpu_features=("avx2",))
    assert rep.buffers["CPU_REPACK model"] > 0 and rep.repacked
    assert not any(n.startswith("token_embd") for n in rep.repacked)   # looked up by row, never multiplied
    dry = weight_placement(tiny, "cpu", mmap=False, cpu_features=("avx2",))
    assert dry.buffers["CPU model"] + dry.buffers["CPU_REPACK model"] == sum(-(-t.n_bytes // 32) * 32
                                                                             for t in tiny.tensors)


def test_partial_offload_is_exact_by_layer(tiny_f16):
    full = weight_placement(tiny_f16, "cuda", -1)
    none = weight_placement(tiny_f16, "cuda", 0)
    assert "CUDA0 model" not in none.buffers and none.n_gpu_layers == 0
    embd = tiny_f16.tensor("token_embd.weight").n_bytes
    assert full.tensor_bytes["CPU_Mapped model"] == embd          # the input layer stays on the host
    output = full.buffers["CUDA0 model"] - sum(tiny_f16.layer_bytes)
    assert output > 0
    for ngl in range(1, 5):                   # the output layer goes first, then the blocks from the last one
        wp = weight_placement(tiny_f16, "cuda", ngl)
        layers = sum(tiny_f16.layer_bytes[5 - ngl:])
        assert wp.output_on_device and wp.n_gpu_layers == ngl - 1
        assert wp.buffers["CUDA0 model"] == layers + output                            # f16: no row padding
    five = weight_placement(tiny_f16, "cuda", 5)
    assert five.output_on_device and five.buffers == full.buffers


def test_metal_maps_instead_of_copying(tiny_f16):
    wp = weight_placement(tiny_f16, "metal", -1)
    assert set(wp.buffers) == {"Metal_Mapped model", "CPU_Mapped model"}
    assert wp.physical_bytes <= sum(wp.buffers.values())


# ---- compute buffer -----------------------------------------------------------------------

def test_rotation_rule():
    assert attn_rotation(128, "q8_0") == 128 and attn_rotation(64, "q4_0") == 64
    assert attn_rotation(128, "f16") == 0 and attn_rotation(96, "q8_0") == 0


def test_compute_grows_with_context_without_flash_attention(tiny):
    small = compute_estimate(tiny, n_kv=512, n_ubatch=512, n_outputs=512, flash_attn=False, kind="cpu", gpu_layers=0)
    big = compute_estimate(tiny, n_kv=8192, n_ubatch=512, n_outputs=512, flash_attn=False, kind="cpu", gpu_layers=0)
    fa = compute_estimate(tiny, n_kv=8192, n_ubatch=512, n_outputs=512, flash_attn=True, kind="cpu", gpu_layers=0)
    kq = 8192 * 512 * 4 * 4          # the attention scores of one layer: kv × tokens × heads × f32
    assert big.device - small.device >= kq - 512 * 512 * 4 * 4
    assert fa.device < big.device and fa.host == 0


def test_compute_holds_the_logits_of_every_output(tiny):
    many = compute_estimate(tiny, n_kv=512, n_ubatch=512, n_outputs=512, flash_attn=True, kind="cpu", gpu_layers=0)
    one = compute_estimate(tiny, n_kv=512, n_ubatch=512, n_outputs=1, flash_attn=True, kind="cpu", gpu_layers=0)
    assert many.device >= 512 * 1000 * 4 + 512 * 256 * 4 and one.device <= many.device


def test_accelerator_has_a_host_compute_buffer(tiny):
    ce = compute_estimate(tiny, n_kv=512, n_ubatch=512, n_outputs=512, flash_attn=True, kind="cuda", gpu_layers=4)
    assert ce.device > 0 and ce.host > 0
