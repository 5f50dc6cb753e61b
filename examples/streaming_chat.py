"""A streaming chat in thirty lines of the Python API (no CLI).

Loads a model through the backend registry, renders each turn with the
model's own chat template (sandboxed; user text never becomes special tokens),
and prints tokens as ``Runner.stream`` yields them.  The runner reuses the KV
cache of the previous turn, so only the new messages are prefilled.

    python examples/streaming_chat.py [MODEL.gguf] [--backend llama.cpp]
"""

from __future__ import annotations

import argparse

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams
from localinfer.model.sources import resolve_model
from localinfer.model.spec import ModelSpec
from localinfer.model.templates import template_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--backend", default="llama.cpp")
    args = ap.parse_args()
    path = resolve_model(args.model)
    spec = ModelSpec.from_gguf(path)
    with load_engine(LoadPlan(str(path), n_ctx=2048), args.backend) as engine:
        template = template_for(spec)
        runner = Runner(engine)
        params = SamplingParams(temperature=0.7, seed=0)
        messages = []
        while True:
            try:
                text = input("you> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return
            messages.append({"role": "user", "content": text})
            reply = []
            print("bot> ", end="", flush=True)
            for chunk in runner.stream(template.tokens(engine, messages), params, max_tokens=256):
                print(chunk.text, end="", flush=True)
                reply.append(chunk.text)
            tm = chunk.timings
            print(f"\n     [{tm.generated} tokens, TTFT {tm.ttft * 1000:.0f} ms, "
                  f"{tm.decode_tok_s or 0:.1f} tok/s, {tm.cached_tokens} prompt tokens reused]")
            messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    main()
