"""Open a GGUF as a paged serving executor: weights, tokenizer, and a pool sized as ``fit`` sizes it.

Pool size: ``num_blocks`` if given; else, with ``gpu_memory_utilization`` on
CUDA, the memory left after the weights —
``⌊(free × utilization − graph bytes) / block bytes⌋``
(``memory.torch_budget_blocks``, ``memory.torch_graph_bytes``); else the plan's
``n_slots × ⌈n_ctx / p⌉`` blocks (``memory.torch_pool_blocks``), whose bytes
are the KV bytes ``fit --backend torch`` prints for ``--ctx n_ctx --parallel n_slots``.

Blocks hold ``BLOCK_TOKENS`` = p tokens: the serving engine's block size
(``localinfer.model.kv.DEFAULT_BLOCK_TOKENS``, which ``memory.TORCH_BLOCK_TOKENS``
is, and which the block manager, ``run_batch`` and ``fit``'s torch memory model
use too: one number, one place).  The executor takes its block tables
from the engine's block manager (``external_blocks=True``; pass
``external_blocks=False`` to drive it by hand with its own tables).
"""

from __future__ import annotations

import os

import torch

from gguf_tools import read_header
from localinfer.backends.engine import LoadPlan
from localinfer.model.spec import ModelSpec

from .engine import pick_device, pick_dtype
from .kv_cache import padded_tokens
from .memory import TORCH_BLOCK_TOKENS, torch_budget_blocks, torch_graph_bytes, torch_pool_blocks
from .model import ModelConfig, Transformer
from .paged_executor import PagedExecutor
from .support import check_kv_types, check_model
from .tokenizer import load_tokenizer
from .weights import load_weights

DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
BLOCK_TOKENS = TORCH_BLOCK_TOKENS     # one block size: the block manager's (localinfer.model.kv), fit's


class Vocab:
    """The file's tokenizer and end-of-generation ids (what ``run_batch`` and ``serve``'s HTTP side and chat
    template ask of an engine)."""

    def __init__(self, tok, spec: ModelSpec):
        self.tok = tok
        self.n_vocab = getattr(tok, "n_vocab", None) or spec.vocab_size
        self.add_bos = bool(getattr(tok, "add_bos", False))
        self.bos_id = tok.bos_id if tok.has_vocab else spec.bos_token_id
        self.eos_ids = tok.eos_ids if tok.has_vocab else frozenset(
            [spec.eos_token_id] if spec.eos_token_id is not None else [])

    def token_text(self, token: int) -> str:
        return self.tok.token_text(token) if self.tok.has_vocab else ""

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.tok.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.tok.token_bytes(token)

    def is_eos(self, token: int) -> bool:
        return token in self.eos_ids

    def close(self) -> None:
        self.tok.close()


def pool_blocks(spec: ModelSpec, n_ctx: int, n_slots: int, type_k: str, type_v: str, device: torch.device,
                dtype: torch.dtype, gpu_memory_utilization: float | None = None) -> int:
    """The pool's blocks for this plan (see the module docstring)."""
    if gpu_memory_utilization is None or device.type != "cuda":
        return torch_pool_blocks(n_ctx, n_slots, BLOCK_TOKENS)
    free, _total = torch.cuda.mem_get_info(device)
    graphs = torch_graph_bytes(spec, n_ctx, n_slots, DTYPE_NAMES[dtype], type_k, type_v, block_tokens=BLOCK_TOKENS)
    return torch_budget_blocks(spec, int(free * gpu_memory_utilization) - graphs, type_k, type_v,
                               block_tokens=BLOCK_TOKENS)


def open_executor(model_path: str | os.PathLike, *, n_slots: int = 8, n_ctx: int = 2048, type_k: str = "f16",
                  type_v: str = "f16", device: str | None = None, dtype: str | None = None,
                  threads: int | None = None, num_blocks: int | None = None,
                  gpu_memory_utilization: float | None = None, packed: bool = False, quiet: bool = True,
                  **options) -> PagedExecutor:
    """A :class:`PagedExecutor` over the file; ``executor.vocab`` is its tokenizer, ``executor.spec`` its spec.

    ``n_ctx`` is the most positions one request holds; ``options`` go to PagedExecutor
    (``external_blocks`` defaults to True: block tables from the serving engine's block manager).
    """
    options.setdefault("external_blocks", True)
    plan = LoadPlan(os.fspath(model_path), n_ctx=n_ctx, n_seq=n_slots, type_k=type_k, type_v=type_v,
                    n_threads=threads, device=device, dtype=dtype, options={"quiet": quiet})
    spec = ModelSpec.from_gguf(read_header(plan.model_path))
    check_model(spec)
    check_kv_types(type_k, type_v, spec.head_dim_k)
    dev = pick_device(plan)
    dt = pick_dtype(plan, spec, dev)
    if threads and dev.type == "cpu":
        torch.set_num_threads(threads)
    tok = load_tokenizer(spec.path, spec.tokenizer_model)
    weights = load_weights(spec, dev, dt, packed=packed, quiet=quiet)
    model = Transformer(ModelConfig.from_spec(spec), weights, padded_tokens(n_ctx), dt)
    blocks = num_blocks or pool_blocks(spec, n_ctx, n_slots, type_k, type_v, dev, dt, gpu_memory_utilization)
    ex = PagedExecutor(model, n_slots=n_slots, num_blocks=blocks, block_size=BLOCK_TOKENS, type_k=type_k,
                       type_v=type_v, max_model_len=n_ctx, **options)
    ex.vocab, ex.spec = Vocab(tok, spec), spec
    return ex


def open_plan(plan: LoadPlan, **options) -> PagedExecutor:
    """The executor for a serving plan (``serve --backend torch``): ``plan.n_seq`` slots sharing ``plan.n_ctx``
    KV positions, as ``fit``'s check of the plan counts them (``check_load``: ⌈n_ctx / n_seq⌉ tokens per
    sequence) — the pool is ``n_seq × ⌈⌈n_ctx / n_seq⌉ / p⌉`` blocks, the bytes fit printed —, and, the pool
    being one for all, one request may hold up to ``n_ctx`` positions (llama.cpp's unified KV; the decode
    graphs' keys, which fit counts as the plan's ``n_ctx_total``).  ``n_gpu_layers=0`` runs on the CPU."""
    n_seq = plan.n_seq
    device = "cpu" if plan.n_gpu_layers == 0 else plan.device
    return open_executor(plan.model_path, n_slots=n_seq, n_ctx=plan.n_ctx, type_k=plan.type_k, type_v=plan.type_v,
                         device=device, dtype=plan.dtype, threads=plan.n_threads,
                         num_blocks=torch_pool_blocks(-(-plan.n_ctx // n_seq), n_seq, BLOCK_TOKENS),
                         packed=bool(plan.options.get("packed")), quiet=plan.options.get("quiet", True), **options)


def open_serving(plan: LoadPlan, *, running: int) -> PagedExecutor:
    """The serving executor (the registry's factory): ``running`` slots over the plan's pool (its blocks keep
    finished requests' prefixes, so it parks no sequences)."""
    return open_plan(plan.with_(n_seq=running))
