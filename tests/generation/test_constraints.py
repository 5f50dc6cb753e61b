"""Constraints on the embedded model's vocabulary: grammars, masks, sync and rollback, batched fills, tool formats.

Random walks draw uniformly among the tokens each mask allows: whatever is drawn, the text must satisfy the
schema (or parse as the format's calls) once the grammar says it is complete.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from localinfer.errors import GrammarError

pytest.importorskip("llguidance")
pytest.importorskip("llama_cpp")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "b": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                            "maxItems": 3}}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}, "v": {"anyOf": [{"type": "null"},
                                                                                   {"type": "number"}]}},
     "required": ["kind"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f]{2}[0-9]$"},
                                      "in": {"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"], "additionalProperties": False}},
     "required": ["code", "in"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def vocab(default_model):
    from localinfer.backends.vocab import VocabOnly

    v = VocabOnly(str(default_model))
    yield v
    v.close()


@pytest.fixture(scope="module")
def tok(vocab):
    from localinfer.generation.constraints import grammar_tokenizer

    t = grammar_tokenizer(vocab)
    assert grammar_tokenizer(vocab) is t          # one per vocabulary
    return t


def _walk(vocab, c, rng, limit=400, short=True):
    """Draw allowed tokens (short ones more often, so walks end) until the grammar completes."""
    for _ in range(limit):
        if c.stopped_after(len(c.tokens)):
            break
        ok = np.flatnonzero(c.allowed())
        ok = ok[~np.isin(ok, list(vocab.eos_ids))] if len(ok) > len(vocab.eos_ids) else ok
        if short:
            lens = np.array([len(vocab.token_bytes(int(t))) or 9 for t in ok])
            ok = ok[lens == lens.min()] if rng.random() < 0.7 else ok
        c.consume(int(rng.choice(ok)))
    return b"".join(vocab.token_bytes(t) for t in c.tokens).decode("utf-8")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_random_walks_satisfy_the_schema(vocab, tok, k, seed):
    from localinfer.generation.constraints import Constraint, grammar_from

    c = Constraint(tok, grammar_from("json_schema", SCHEMAS[k], "schema"))
    text = _walk(vocab, c, np.random.default_rng(seed))
    assert c.stopped_after(len(c.tokens)), text
    jsonschema.validate(json.loads(text), SCHEMAS[k])


@pytest.mark.parametrize("kind,value,field", [
    ("json_schema", {"type": "nope"}, "response_format.json_schema.schema"), ("json_schema", [1], "s"),
    ("regex", "(", "regex"), ("regex", "", "regex"), ("choice", [], "choice"), ("choice", ["a", ""], "choice"),
    ("lark", "start: nothing_here", "grammar"), ("lark", 5, "grammar"), ("yaml", "x", "k")])
def test_grammars_that_do_not_compile_name_their_field(kind, value, field):
    from localinfer.generation.constraints import grammar_from

    with pytest.raises(GrammarError) as err:
        grammar_from(kind, value, field)
    assert err.value.field == field and "\n" not in str(err.value) and str(err.value).startswith(field)


def test_sync_rolls_back_and_masks_follow_the_output(vocab, tok):
    from localinfer.generation.constraints import Constraint, grammar_from

    g = grammar_from("json_schema", SCHEMAS[0], "s")
    a = Constraint(tok, g)
    text = _walk(vocab, a, np.random.default_rng(5))
    out = list(a.tokens)
    for n in (len(out) - 1, len(out) // 2, 3, 0):
        a.sync(out[:n])                           # a draft not kept, a preemption: fewer tokens than consumed
        fresh = Constraint(tok, g)
        fresh.sync(out[:n])
        assert a.tokens == out[:n] and np.array_equal(a.mask(), fresh.mask())
        assert not a.stopped_after(n)
    a.sync(out)
    assert a.stopped_after(len(out)) and json.loads(text)
    b = a.clone()
    b.sync(out[:2])
    assert a.tokens == out and a.stopped_after(len(out))


def test_batched_fill_with_drafts_equals_single_masks(vocab, tok):
    from localinfer.generation.constraints import Constraint, fill_masks, grammar_from

    cs = [Constraint(tok, grammar_from("json_schema", s, "s")) for s in SCHEMAS]
    walks = []
    for i, c in enumerate(cs):
        _walk(vocab, c, np.random.default_rng(10 + i))
        walks.append(list(c.tokens))
    items = [(c, w[:4], w[4:7] if i != 1 else ()) for i, (c, w) in enumerate(zip(cs, walks))]
    fill_masks(items)
    for c, out, draft in items:
        for j in range(len(draft) + 1):
            filled = c.mask().copy()
            probe = c.clone()
            probe._rows = None
            assert np.array_equal(filled, probe.mask()), (j, draft)
            if j < len(draft):
                c.consume(draft[j])


def test_masks_and_sampler_apply(vocab, tok):
    from localinfer.generation.constraints import Constraint, grammar_from
    from localinfer.generation.sampling import Sampler, SamplingParams

    c = Constraint(tok, grammar_from("choice", ["yes", "no"], "choice"))
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(vocab.n_vocab + 7).astype(np.float32)     # padded rows: ids past the vocabulary
    masked = c.apply(logits)
    allowed = np.flatnonzero(np.isfinite(masked))
    assert 0 < len(allowed) < 20 and (allowed < vocab.n_vocab).all()
    s = Sampler(SamplingParams(temperature=1.0, seed=3), constraint=c)
    while not c.stopped_after(len(c.tokens)):
        s.sample(rng.standard_normal(vocab.n_vocab).astype(np.float32), [])
    assert b"".join(vocab.token_bytes(t) for t in c.tokens) in (b"yes", b"no")


def test_apply_forbids_exactly_what_the_mask_forbids_sparse_dense_or_between(vocab, tok):
    from localinfer.generation.constraints import Constraint, grammar_from

    rng = np.random.default_rng(1)
    cases = [("choice", ["yes", "no"], ""),                                        # sparse: the allowed ids
             ("regex", "[^a]*", "bcd"),                                            # between: a 0 / −inf bias
             ("json_schema", {"type": "object", "properties": {"s": {"type": "string"}}}, '{"s": "ab')]  # few out
    for kind, value, prefix in cases + cases[::-1]:          # each path after each other: reused buffers
        c = Constraint(tok, grammar_from(kind, value, kind))
        c.sync(tok.tokenize_str(prefix))
        logits = rng.standard_normal(vocab.n_vocab + 7).astype(np.float32)
        want = np.full_like(logits, -np.inf)
        ok = c.allowed()
        want[:vocab.n_vocab][ok] = logits[:vocab.n_vocab][ok]
        np.testing.assert_array_equal(c.apply(logits), want)
        np.testing.assert_array_equal(c.apply(logits), want)


def test_allows_says_what_the_mask_says_for_every_token_filled_or_not(vocab, tok):
    """Every token id in every state of walks through each schema, its end included (EOS only where the grammar
    accepts, and once it is complete), and ids past the vocabulary: allows() is the mask's bit."""
    from localinfer.generation.constraints import Constraint, grammar_from

    rng = np.random.default_rng(5)
    eos = sorted(vocab.eos_ids)
    for k, schema in enumerate(SCHEMAS):
        grammar = grammar_from("json_schema", schema, "schema")
        walk = Constraint(tok, grammar)
        _walk(vocab, walk, rng)
        c = Constraint(tok, grammar)
        for n in range(len(walk.tokens) + 1):
            c.sync(walk.tokens[:n])
            fresh = c.clone()                       # no mask filled: the matcher's check of the one token
            want = c.allowed()                      # fills c's mask: the bit
            sample = np.unique(np.concatenate([eos, np.flatnonzero(want), rng.integers(0, vocab.n_vocab, 300)]))
            assert [fresh.allows(int(t)) for t in sample] == want[sample].tolist(), (k, n)
            assert [c.allows(int(t)) for t in sample] == want[sample].tolist(), (k, n)
            assert not c.allows(vocab.n_vocab) and not fresh.allows(-1)
        assert c.stopped_after(len(c.tokens)) and all(c.clone().allows(t) for t in eos)


def test_a_draw_without_the_mask_first_is_the_masked_draw(vocab, tok):
    """Greedy: the same token as the argmax of the masked logits, state after state.  Temperature alone: the
    draws kept or redrawn under the mask follow the masked distribution (rejection sampling); with top-k the mask
    comes first."""
    from localinfer.generation.constraints import Constraint, grammar_from
    from localinfer.generation.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(7)
    grammar = grammar_from("json_schema", SCHEMAS[0], "schema")
    c, ref = Constraint(tok, grammar), Constraint(tok, grammar)
    s = Sampler(SamplingParams(temperature=0.0), constraint=c)
    assert s.draws_unmasked_first
    unmasked = 0
    while not c.stopped_after(len(c.tokens)) and len(c.tokens) < 60:
        logits = rng.standard_normal(vocab.n_vocab).astype(np.float32)
        top = int(np.argmax(logits))
        logits[tok.tokenize_str('{"a": 1')[:1] if not c.tokens else [top]] += 6.0   # often allowed, sometimes not
        want = int(np.argmax(ref.apply(logits)))
        unmasked += c._filled() is None and c.allows(int(np.argmax(logits)))
        assert s.sample(logits, []) == want
        ref.consume(want)
    assert unmasked > 0 and c.stopped_after(len(c.tokens))

    c = Constraint(tok, grammar_from("choice", ["yes", "no", "maybe"], "choice"))
    ids = np.flatnonzero(c.allowed())
    logits = np.full(vocab.n_vocab, -30.0, dtype=np.float32)    # the draws are the allowed ids or the one below
    logits[ids] = np.linspace(0.0, 1.5, len(ids))
    logits[int(np.argmax(logits < 0))] = 2.0                    # the likeliest token is one the grammar refuses
    p = np.exp(logits[ids] - logits[ids].max())
    p /= p.sum()
    assert not Sampler(SamplingParams(temperature=1.0, top_k=40), constraint=c).draws_unmasked_first
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11), constraint=c)
    assert s.draws_unmasked_first
    counts = np.zeros(len(ids))
    for _ in range(3000):
        fresh = c.clone()
        s.constraint = fresh
        counts[np.searchsorted(ids, s.sample(logits, []))] += 1
    assert 0.5 * np.abs(counts / counts.sum() - p).sum() < 0.04     # total variation, 3000 draws
