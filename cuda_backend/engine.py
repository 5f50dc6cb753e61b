"""TorchEngine: the engine contract on the PyTorch model (registry name ``torch``).

Loads a GGUF through :mod:`cuda_backend.weights`, runs :class:`Transformer`
over a per-sequence :class:`KVCache`, tokenizes with the file's own tokenizer
through llama.cpp's vocab-only load (so token ids equal the llama.cpp
backend's).  CUDA when available (bf16), otherwise CPU (float32) after a
one-line notice.

``plan.n_ctx`` is the total context, split evenly over ``plan.n_seq``
sequences, as the llama.cpp backend splits it.

Options (``plan.options``): ``quiet`` (no progress bar), ``packed`` (keep
q8_0/q4_0 matrices as GGUF blocks), ``llamacpp_rounding`` (compute as llama.cpp's
x86 CPU kernels do, :mod:`cuda_backend.ggml_numerics`: with q4_0/q4_1/q8_0 weights
and an f16 KV cache the logits equal llama.cpp's to the bit, flash attention on;
other types get its activation rounding only.  float32, CPU speed of a reference:
a verification mode, not a fast path).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from gguf_tools import read_header
from localinfer.backends.engine import Engine, LoadPlan
from localinfer.backends.llamacpp.memory import outputs_cap
from localinfer.backends.memory import NOT_RESIDENT, check_weight_dtype
from localinfer.errors import ContextFullError, UsageError
from localinfer.model.spec import ModelSpec

from . import ggml_numerics
from .kv_cache import KVCache, padded_tokens
from .memory import default_dtype
from .model import ModelConfig, Transformer
from .support import check_kv_types, check_model
from .tokenizer import load_tokenizer
from .weights import load_weights, weights_nbytes

DTYPES = {"f32": torch.float32, "float32": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "f16": torch.float16, "float16": torch.float16, "fp16": torch.float16}


def pick_device(plan: LoadPlan) -> torch.device:
    """CUDA if asked for (or by default) and present; otherwise CPU, saying so once."""
    want = (plan.device or ("cpu" if plan.n_gpu_layers == 0 else "cuda")).lower()
    if want == "gpu":
        want = "cuda"
    if want.startswith("cuda"):
        if torch.cuda.is_available():
            return torch.device(want)
        if plan.device or not plan.options.get("quiet"):
            print("torch: no CUDA device found; running on the CPU", file=sys.stderr)
        return torch.device("cpu")
    if want != "cpu":
        raise UsageError(f"the torch backend runs on cuda or cpu, not {plan.device!r}", flag="--device")
    return torch.device("cpu")


def pick_dtype(plan: LoadPlan, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The weight dtype asked for, else the one `fit --backend torch` assumes (bf16 on CUDA, f32 on CPU)."""
    return DTYPES[check_weight_dtype(plan.dtype) or default_dtype(spec, device.type)]


class TorchEngine(Engine):
    """One GGUF model in torch with ``plan.n_seq`` independent KV sequences."""

    name = "torch"

    def __init__(self, plan: LoadPlan):
        super().__init__(plan)
        self.model = self.cache = None
        self.tok = None
        header = read_header(plan.model_path)
        self.spec = spec = ModelSpec.from_gguf(header)
        check_model(spec)
        check_kv_types(plan.type_k, plan.type_v, spec.head_dim_k)
        self.n_ctx = max(1, plan.n_ctx // plan.n_seq)
        self.device = pick_device(plan)
        self.dtype = pick_dtype(plan, spec, self.device)
        if plan.n_threads and self.device.type == "cpu":
            torch.set_num_threads(plan.n_threads)
        opts = plan.options
        emulate = bool(opts.get("llamacpp_rounding", False))
        if emulate and (why := ggml_numerics.kernel_mismatch()):
            print(f"torch: llamacpp_rounding follows llama.cpp's x86 AVX2 kernels, but {why}: "
                  "logits will be close to llama.cpp's, not equal", file=sys.stderr)
        self.tok = load_tokenizer(spec.path, spec.tokenizer_model)
        weights = load_weights(spec, self.device, self.dtype, packed=bool(opts.get("packed")), llamacpp_rounding=emulate,
                               quiet=bool(opts.get("quiet")))
        self.weight_bytes = weights_nbytes({k: w for k, w in weights.items() if k not in NOT_RESIDENT})
        cfg = ModelConfig.from_spec(spec)
        types = {t.name: t.type.name for t in spec.tensors} if emulate else None
        self.model = Transformer(cfg, weights, padded_tokens(self.n_ctx), self.dtype, types)  # = cache capacity
        if emulate:
            pad = ggml_numerics.KV_VIEW_PAD
            self.model.ggml_ctx_cells = -(-self.n_ctx // pad) * pad
            self.model.ggml_threads = plan.threads
            # the decodes and ubatches the llama.cpp backend cuts this plan's prefills into
            self.model.ggml_ubatch = min(plan.n_ubatch, plan.n_batch)
            self.model.ggml_outputs_max = outputs_cap(plan)
        self.cache = KVCache(cfg.n_layers, plan.n_seq, self.n_ctx, cfg.n_head_kv, cfg.head_dim,
                             plan.type_k, plan.type_v, device=self.device, dtype=self.dtype)
        self.n_vocab = cfg.vocab_size
        self.bos_id = self.tok.bos_id if self.tok.has_vocab else spec.bos_token_id
        self.eos_ids = self.tok.eos_ids if self.tok.has_vocab else frozenset(
            [spec.eos_token_id] if spec.eos_token_id is not None else [])

    # ---- tokenizer ---------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.tok.tokenize(text, add_bos=add_bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self.tok.token_bytes(token)

    # ---- KV cache ----------------------------------------------------------
    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} outside 0..{self.n_seq - 1}")

    def kv_len(self, seq: int = 0) -> int:
        self._check_seq(seq)
        return self.cache.lens[seq]

    def _trim(self, n: int, seq: int) -> None:
        self.cache.trim(seq, n)

    # ---- evaluation --------------------------------------------------------
    def _tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        t = torch.tensor(list(tokens), dtype=torch.long)
        if int(t.min()) < 0 or int(t.max()) >= self.n_vocab:
            raise ValueError(f"token ids must be in 0..{self.n_vocab - 1}")
        return t.to(self.device)

    @torch.inference_mode()
    def _eval_chunk(self, tokens, start, logits_at, seq):
        self._check_seq(seq)
        ids = self._tokens(tokens)
        rows = torch.tensor(list(logits_at), dtype=torch.long, device=self.device)
        logits = self.model.prefill(ids, start, self.cache, seq, rows)
        self.cache.lens[seq] = start + len(tokens)
        return logits.cpu().numpy() if len(logits_at) else None

    @torch.inference_mode()
    def eval_batch(self, steps: dict[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """One batched forward for the sequences that add one token each; others one by one."""
        singles = sorted(s for s, toks in steps.items() if len(toks) == 1)
        out = {s: self.eval(toks, seq=s)[0] for s, toks in steps.items() if len(toks) != 1}
        if len(singles) == 1:
            out[singles[0]] = self.eval(steps[singles[0]], seq=singles[0])[0]
        elif singles:
            for s in singles:
                self._check_seq(s)
                if self.cache.lens[s] + 1 > self.n_ctx:
                    raise ContextFullError(f"sequence {s} is full ({self.n_ctx} tokens)", needed=self.n_ctx + 1,
                                           available=self.n_ctx, hint="use a larger --ctx")
            ids = self._tokens([steps[s][0] for s in singles])
            starts = [self.cache.lens[s] for s in singles]
            pos = torch.tensor(starts, dtype=torch.long, device=self.device)
            seqs = None if singles == list(range(len(singles))) else torch.tensor(singles, device=self.device)
            logits = self.model.decode(ids, pos, self.cache, seqs, n_attn=max(starts) + 1).cpu().numpy()
            for i, s in enumerate(singles):
                self.cache.lens[s] += 1
                out[s] = logits[i]
        return out

    # ---- resources ---------------------------------------------------------
    def memory(self) -> dict[str, int]:
        mem = {"weights": self.weight_bytes, "kv": self.cache.nbytes if self.cache else 0}
        if self.device.type == "cuda":
            mem["compute"] = max(0, torch.cuda.max_memory_allocated(self.device) - sum(mem.values()))
        return mem

    def close(self) -> None:
        self.model = self.cache = None
        if self.tok is not None:
            self.tok.close()
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
