"""The torch backend on a GPU: an 8B-shaped BF16 model (Qwen3-8B dimensions, random weights
made on the device, nothing downloaded), decode at batch 1/4/16/64 × context 2K/8K in a CUDA
graph, prefill, side by side with Hugging Face transformers (static cache, the same weights
and dtype) when it is installed.  Reports MBU against the device profile and the batch-64
step against the roofline max(b·F/P, (D_w + b·L·k)/β) (SPEC §8.2).

    python benchmarks/gpu_torch.py [--profile h200] [--steps 32] [--json benchmarks/results/gpu_torch_h200.json]
    python benchmarks/gpu_torch.py --tiny        # a 2-layer model on the CPU: proves the script runs

Targets (H200): batch-1 decode MBU >= 70% and >= 1.3x transformers; batch-64 step <= 1.25x roofline.
Decode steps attend over the whole static cache (capacity = context + steps), as the graph needs;
cache contents are zeros, which costs the same as real keys.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WHEEL_DIRS = (".whl", "benchmarks/wheels")     # where ensure_gguf looks for a carried gguf wheel


def ensure_gguf() -> str | None:
    """Make ``gguf`` importable (localinfer reads its constants through gguf_tools).  A GPU machine without it
    (and without internet) gets it from a carried pure-Python wheel: ``$GGUF_WHEEL`` (a file or a folder) or
    ``.whl/`` / ``benchmarks/wheels/`` in the checkout, unpacked into a temporary folder put on sys.path.
    The wheel's path, or None when gguf was installed already."""
    try:
        import gguf  # noqa: F401
        return None
    except ImportError:
        pass
    places = [os.environ.get("GGUF_WHEEL", "")] + [str(ROOT / d) for d in WHEEL_DIRS]
    for place in filter(None, places):
        wheels = [place] if os.path.isfile(place) else sorted(glob.glob(os.path.join(place, "gguf-*.whl")))
        for whl in wheels:
            if os.path.isfile(whl):
                target = tempfile.mkdtemp(prefix="gguf-wheel-")
                with zipfile.ZipFile(whl) as z:
                    z.extractall(target)
                sys.path.insert(0, target)
                importlib.invalidate_caches()
                return whl
    raise SystemExit("the gguf package is missing and no wheel was found: here, `python3 -m pip download --no-deps "
                     "-d .whl gguf` (pure Python), then carry .whl (or set GGUF_WHEEL)")


GGUF_WHEEL = ensure_gguf()

import torch

from cuda_backend.graphs import GraphDecoder
from cuda_backend.kv_cache import KVCache
from cuda_backend.model import ModelConfig, Transformer
from cuda_backend.rope import RopeConfig

QWEN3_8B = {"n_layers": 36, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "head_dim": 128, "n_ff": 12288, "vocab_size": 151936}
TINY = {"n_layers": 2, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 512, "vocab_size": 1024}


def device_profile(name: str):
    """The device profile by name; from the checkout's profiles/ when localinfer is not installed (the
    built-in profiles are the package ``localinfer.profiles`` only in an installed copy)."""
    from localinfer.devices.profiles import get_device, load_profile_file

    try:
        return get_device(name)
    except ModuleNotFoundError:
        return load_profile_file(ROOT / "profiles" / f"{name}.toml")


def make_config(dims: dict) -> ModelConfig:
    return ModelConfig(arch="qwen3", rms_eps=1e-6, qk_norm=True,
                       rope=RopeConfig(n_rot=dims["head_dim"], base=1e6, pairing="neox"), **dims)


def random_weights(cfg: ModelConfig, device, dtype) -> dict[str, torch.Tensor]:
    """GGUF-named tensors in torch order, made on the device (std 0.02; norms 1)."""
    g = torch.Generator(device=device).manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=torch.float32)

    c, q, kv = cfg, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    w = {"token_embd.weight": mat(c.vocab_size, c.n_embd), "output.weight": mat(c.vocab_size, c.n_embd),
         "output_norm.weight": ones(c.n_embd)}
    for il in range(c.n_layers):
        p = f"blk.{il}."
        w.update({p + "attn_norm.weight": ones(c.n_embd), p + "ffn_norm.weight": ones(c.n_embd),
                  p + "attn_q_norm.weight": ones(c.head_dim), p + "attn_k_norm.weight": ones(c.head_dim),
                  p + "attn_q.weight": mat(q, c.n_embd), p + "attn_k.weight": mat(kv, c.n_embd),
                  p + "attn_v.weight": mat(kv, c.n_embd), p + "attn_output.weight": mat(c.n_embd, q),
                  p + "ffn_gate.weight": mat(c.n_ff, c.n_embd), p + "ffn_up.weight": mat(c.n_ff, c.n_embd),
                  p + "ffn_down.weight": mat(c.n_embd, c.n_ff)})
    return w


def figures(cfg: ModelConfig, weights: dict) -> dict:
    """D_w (matrix bytes read per step; the embedding is looked up by row), F (FLOPs per token), k."""
    matrices = [t for n, t in weights.items() if t.dim() == 2 and n != "token_embd.weight"]
    d_w = sum(t.numel() * t.element_size() for t in matrices)
    flops = 2 * sum(t.numel() for t in matrices)
    k = 2 * cfg.n_layers * cfg.n_head_kv * cfg.head_dim * 2
    return {"D_w": d_w, "F": flops, "k": k}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours_decode(model, cfg, device, batches, ctx, steps) -> dict[int, float]:
    cache = KVCache(cfg.n_layers, max(batches), ctx + steps + 16, cfg.n_head_kv, cfg.head_dim, "bf16", "bf16",
                    device=device, dtype=model.dtype)
    out = {}
    for b in batches:
        dec = GraphDecoder(model, cache, b)
        tokens = torch.zeros(b, dtype=torch.long, device=device)
        for i in range(2):
            dec(tokens, torch.full((b,), ctx + i, device=device))
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            dec(tokens, torch.full((b,), ctx + i, device=device))
        sync(device)
        out[b] = (time.perf_counter() - t0) / steps
        del dec
    del cache
    return out


def ours_prefill(model, cfg, device, n: int) -> float:
    cache = KVCache(cfg.n_layers, 1, n, cfg.n_head_kv, cfg.head_dim, "bf16", "bf16", device=device, dtype=model.dtype)
    tokens = torch.randint(0, cfg.vocab_size, (n,), device=device)
    with torch.inference_mode():
        model.prefill(tokens, 0, cache, 0, torch.tensor([n - 1], device=device))
        sync(device)
        t0 = time.perf_counter()
        model.prefill(tokens, 0, cache, 0, torch.tensor([n - 1], device=device))
        sync(device)
    return n / (time.perf_counter() - t0)


def hf_model(cfg: ModelConfig, weights: dict, device, dtype):
    """transformers' Qwen3 with our tensors as its parameters (norms copied to the model dtype)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hc = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_head,
                     num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim, rope_theta=cfg.rope.base,
                     rms_norm_eps=cfg.rms_eps, tie_word_embeddings=False, max_position_embeddings=32768)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hc)
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    hf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for il in range(cfg.n_layers):
        for a, b in hf.items():
            names[f"model.layers.{il}.{a}.weight"] = f"blk.{il}.{b}.weight"
    state = {n: weights[g].to(dtype) for n, g in names.items()}
    model.load_state_dict(state, assign=True, strict=False)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hc).to(device)
    return model.eval(), hc


def hf_decode(model, hc, device, batches, ctx, steps, compile_: bool) -> dict[int, float]:
    from transformers import StaticCache

    out = {}
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compile_ else model.forward
    for b in batches:
        try:
            cache = StaticCache(config=hc, max_batch_size=b, max_cache_len=ctx + steps + 16, device=device,
                                dtype=model.dtype)
        except TypeError:
            cache = StaticCache(config=hc, max_cache_len=ctx + steps + 16)
        ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        with torch.inference_mode():
            for i in range(3 + steps):
                if i == 3:
                    sync(device)
                    t0 = time.perf_counter()
                pos = torch.tensor([ctx + i], device=device)
                fwd(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos.expand(b, 1),
                    use_cache=True)
            sync(device)
        out[b] = (time.perf_counter() - t0) / steps
        del cache
    return out


def hf_agreement(model, cfg, hf, device) -> float:
    """max |Δlogit| / max |logit| of one 16-token prompt, ours vs transformers (same weights)."""
    tokens = torch.randint(0, cfg.vocab_size, (16,), device=device, generator=torch.Generator(device).manual_seed(1))
    cache = KVCache(cfg.n_layers, 1, 32, cfg.n_head_kv, cfg.head_dim, "bf16", "bf16", device=device,
                    dtype=model.dtype)
    with torch.inference_mode():
        ours = model.prefill(tokens, 0, cache, 0, torch.tensor([15], device=device))[0].float()
        theirs = hf(input_ids=tokens[None]).logits[0, -1].float()
    return float((ours - theirs).abs().max() / theirs.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="2-layer model on the CPU")
    ap.add_argument("--profile", default="h200", help="device profile for MBU and roofline")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-hf-compile", action="store_true")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dims = TINY if args.tiny else QWEN3_8B
    batches = [int(x) for x in (("1,4" if args.tiny else args.batches).split(","))]
    contexts = [int(x) for x in (("64,128" if args.tiny else args.contexts).split(","))]
    prefill_n = 64 if args.tiny else args.prefill
    dtype = torch.bfloat16

    prof = device_profile(args.profile)
    beta, peak = prof.bandwidth_bytes_per_s, prof.bf16_flops
    cfg = make_config(dims)
    weights = random_weights(cfg, device, dtype)
    model = Transformer(cfg, weights, max(contexts) + args.steps + 64, dtype)
    fig = figures(cfg, weights)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (--tiny)",
              "profile": prof.name, "model": "qwen3-8b-shape" if not args.tiny else "tiny", **fig,
              "torch": torch.__version__, "decode": [], "prefill": {}}
    hf = None
    if not args.no_hf:
        try:
            hf = hf_model(cfg, weights, device, dtype)
            import transformers

            result["transformers"] = transformers.__version__
            result["hf_rel_logit_diff"] = hf_agreement(model, cfg, hf[0], device)
        except Exception as exc:  # noqa: BLE001 - report and go on without the column
            print(f"transformers column skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"{result['device']}: D_w {fig['D_w'] / 1e9:.2f} GB, F {fig['F'] / 1e9:.1f} GFLOP/token, "
          f"k {fig['k']} B/token; profile {prof.name}: {beta / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s")
    if "hf_rel_logit_diff" in result:
        print(f"same model check: transformers logits differ from ours by {result['hf_rel_logit_diff']:.1e} "
              f"of the largest (bf16)")
    print(f"{'ctx':>6}{'batch':>6}{'step ms':>10}{'tok/s':>10}{'MBU':>7}{'roofline ms':>13}{'x roof':>10}"
          f"{'HF ms':>9}{'HF tok/s':>10}{'ours/HF':>9}")
    for ctx in contexts:
        ours = ours_decode(model, cfg, device, batches, ctx, args.steps)
        theirs = {}
        if hf is not None:
            try:
                theirs = hf_decode(hf[0], hf[1], device, batches, ctx, args.steps, not args.no_hf_compile)
            except Exception as exc:  # noqa: BLE001
                print(f"transformers decode failed at ctx {ctx}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for b in batches:
            t = ours[b]
            bytes_read = fig["D_w"] + b * ctx * fig["k"]
            roof = max(b * fig["F"] / peak, bytes_read / beta)
            row = {"ctx": ctx, "batch": b, "step_s": t, "tok_s": b / t, "mbu": bytes_read / t / beta,
                   "roofline_s": roof, "x_roofline": t / roof}
            if b in theirs:
                row.update(hf_step_s=theirs[b], hf_tok_s=b / theirs[b], ours_over_hf=theirs[b] / t)
            result["decode"].append(row)
            hf_cols = (f"{theirs[b] * 1e3:9.2f}{b / theirs[b]:10.1f}{theirs[b] / t:9.2f}" if b in theirs
                       else f"{'-':>9}{'-':>10}{'-':>9}")
            print(f"{ctx:6}{b:6}{t * 1e3:10.2f}{b / t:10.1f}{row['mbu']:7.0%}{roof * 1e3:13.3f}{t / roof:10.2f}"
                  + hf_cols)
    rate = ours_prefill(model, cfg, device, prefill_n)
    result["prefill"] = {"tokens": prefill_n, "tok_s": rate, "mfu": rate * fig["F"] / peak}
    print(f"prefill {prefill_n} tokens: {rate:.0f} tok/s (MFU {result['prefill']['mfu']:.0%}, "
          f"matmul FLOPs only)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
