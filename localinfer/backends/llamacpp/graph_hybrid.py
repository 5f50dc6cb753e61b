"""Hybrid recurrent graphs (delta-net, Mamba-2, short-conv layers beside attention), registered for
compute_buffer's ``graph_builder``.

Each family module records its graph on a :class:`~.ggml_dag.Dag` in the order llama.cpp's builder expands it
(:mod:`.graph_deltanet`: src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp; :mod:`.graph_mamba2`:
mamba.cpp, mamba2.cpp, granite-hybrid.cpp, nemotron-h.cpp; :mod:`.graph_shortconv`: lfm2.cpp); the SSM sizes come from
the header's ``{arch}.ssm.*`` / ``{arch}.shortconv.*`` keys.  The worst-case ubatch has n_seq_max sequences
(llama-context.cpp ``graph_reserve``), which the recurrent ops' shapes depend on.
"""

from __future__ import annotations

import importlib

from localinfer.backends.llamacpp.compute_buffer import _Graph
from localinfer.backends.llamacpp.ggml_dag import Dag
from localinfer.backends.llamacpp.hybrid_blocks import Ubatch
from localinfer.model.spec import ModelSpec
from localinfer.util.memo import spec_cache

_FAMILIES = {"graph_deltanet": ("qwen35", "qwen35moe", "qwen3next"),
             "graph_mamba2": ("mamba", "mamba2", "granitehybrid", "nemotron_h", "nemotron_h_moe"),
             "graph_shortconv": ("lfm2", "lfm2moe")}
# checked byte for byte against llama.cpp's CPU dry run (tests/backends/test_compute_hybrid.py)
VERIFIED: tuple[str, ...] = ("qwen35", "qwen35moe", "qwen3next", "mamba", "mamba2", "granitehybrid", "nemotron_h",
                             "nemotron_h_moe", "lfm2", "lfm2moe")


def _header(spec: ModelSpec) -> dict:
    """The file's metadata, read once per spec (the SSM sizes are not in ModelSpec)."""
    memo = spec_cache(spec)
    if "header_kv" not in memo:
        from gguf_tools import read_header

        try:
            memo["header_kv"] = dict(read_header(spec.path, check_data=False).kv)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {spec.path}'s SSM sizes: {exc}") from exc
    return memo["header_kv"]


def GRAPH(spec: ModelSpec, layers: list[int], n_kv: int, n_tokens: int, n_outputs: int, flash_attn: bool,
          n_kv_swa: int, type_k: str = "f16", type_v: str = "f16", n_seqs: int = 1, n_stream: int = 1) -> _Graph:
    """The node sequence llama.cpp builds for the worst-case ubatch of a hybrid model (all layers)."""
    for module, archs in _FAMILIES.items():
        if spec.arch in archs:
            family = importlib.import_module(f"{__package__}.{module}")
            break
    else:
        raise ValueError(f"no hybrid graph for {spec.arch!r}")
    try:
        header = _header(spec)
        u = Ubatch(Dag(), spec, n_tokens, max(1, n_seqs), n_outputs, n_kv, n_kv_swa, flash_attn, type_k, type_v,
                   header)
        family.graph(u)
    except KeyError as exc:
        raise ValueError(f"{spec.arch}: metadata {exc} missing for its graph") from exc
    return u.dag.g
