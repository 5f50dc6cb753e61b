"""Prompt-lookup decoding from the Python API: the same greedy reply, fewer engine rounds.

Asks the embedded SmolLM2-135M to rename a function in a piece of code (a reply
that mostly copies its input), once with plain decoding and once with a
``LookupDecoder``, and prints both timings, the draft statistics and whether
the two replies are identical.  The CLI equivalent is
``localinfer run --lookup -p "..."``.

    python examples/prompt_lookup.py [--tokens 160] [--threads 1]
"""

from __future__ import annotations

import argparse

from localinfer.backends.engine import LoadPlan
from localinfer.backends.registry import load_engine
from localinfer.generation.lookup import LookupDecoder
from localinfer.generation.runner import Runner
from localinfer.generation.sampling import SamplingParams
from localinfer.model.sources import default_model_path
from localinfer.model.spec import ModelSpec
from localinfer.model.templates import template_for

CODE = '''def word_counts(path):
    counts = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            for word in line.lower().split():
                word = word.strip(".,;:!?\\"'()")
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(path, n=10):
    counts = word_counts(path)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:n]


def print_top_words(path, n=10):
    for word, count in top_words(path, n):
        print(f"{count:6d}  {word}")
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (1: bit-identical replies)")
    args = ap.parse_args()

    model = str(default_model_path())
    engine = load_engine(LoadPlan(model, n_ctx=2048, n_threads=args.threads))
    template = template_for(ModelSpec.from_gguf(model))
    prompt = template.tokens(engine, [{"role": "user", "content":
                                       "Rename the function word_counts to count_words everywhere in this code "
                                       "and print the whole code again.\n\n" + CODE}])
    runner = Runner(engine)
    greedy = SamplingParams(greedy=True)

    plain = runner.generate(prompt, greedy, max_tokens=args.tokens)
    runner.reset()
    decoder = LookupDecoder()
    lookup = runner.generate(prompt, greedy, max_tokens=args.tokens, decoder=decoder)

    print(lookup.text)
    print("-" * 60)
    for name, gen in (("plain", plain), ("lookup", lookup)):
        tm = gen.timings
        print(f"{name:7} {len(gen.tokens)} tokens, decode {tm.decode_tok_s or 0:.1f} tok/s")
    st = decoder.stats
    print(f"lookup: {st.rounds} rounds for {st.emitted} tokens ({st.tokens_per_round:.2f} per round), "
          f"{st.accepted}/{st.drafted} drafts accepted, lookup {1000 * st.lookup_seconds:.1f} ms in all")
    if plain.timings.decode_tok_s and lookup.timings.decode_tok_s:
        print(f"speedup {lookup.timings.decode_tok_s / plain.timings.decode_tok_s:.2f}x; "
              f"identical reply: {plain.tokens == lookup.tokens}")
    engine.close()


if __name__ == "__main__":
    main()
