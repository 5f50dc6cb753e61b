"""`localinfer bench --batch-sizes`: batch scaling through the serving engine (embedded model, 1 thread).

b requests of N tokens each must give b·N tokens in N − 1 decode steps after one
prefill step; the bytes per output token follow d(b, L) = D_w/b + L·k
(docs/speed.md) at the decode tokens' mean context, and fall with b.
"""

import itertools
import json

import pytest

from localinfer.cli import main
from localinfer.generation.bench import VERSION, batch_row, render_table, results
from localinfer.model.cost import model_cost
from localinfer.model.spec import ModelSpec

pytest.importorskip("llama_cpp")

GEN, DEPTHS, BATCHES = 4, (0, 12), (1, 2, 4)
ARGV = ["bench", "--kv", "f16", "--prompt-lengths", "8", "--depths", ",".join(map(str, DEPTHS)), "--gen", str(GEN),
        "-t", "1", "--repeats", "2", "--batch-sizes", ",".join(map(str, BATCHES))]


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-batch") / "bench.json"
    assert main([*ARGV, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cost(default_model):
    return model_cost(ModelSpec.from_gguf(str(default_model)))


def test_schema_extends_version_1(doc):
    assert doc["version"] == VERSION == 2
    assert [r["type_k"] for r in doc["runs"]] == ["f16"] and doc["runs"][0]["decode"]     # version 1 keys kept
    assert doc["settings"]["batch_sizes"] == list(BATCHES) and doc["settings"]["depths"] == list(DEPTHS)
    sec = doc["batch_scaling"]
    assert sec["type_k"] == sec["type_v"] == "f16" and sec["gen_tokens"] == GEN and sec["kv_unified"] is False
    assert [(r["depth"], r["batch"]) for r in sec["rows"]] == [(d, b) for d in DEPTHS for b in BATCHES]


def test_every_request_yields_n_tokens_in_n_minus_1_decode_steps(doc):
    for r in doc["batch_scaling"]["rows"]:
        b = r["batch"]
        assert r["tokens"] == b * GEN and r["decode_tokens"] == b * (GEN - 1) and r["decode_steps"] == GEN - 1
        assert r["mean_context"] == max(r["depth"], 1) + GEN / 2          # keys attended by decode tokens
        assert r["tok_s"] == pytest.approx(r["decode_tokens"] / r["decode_s"])
        assert 0 < r["request_tok_s"] <= r["tok_s"] * 1.001
        assert r["prefill_s"] > 0 and 0 <= r["step_overhead"] < 1


def test_bytes_per_token_follow_the_formula_and_fall_with_batch(doc, cost):
    sec = doc["batch_scaling"]
    assert sec["weight_read_bytes"] == cost.decode_read_bytes(1) and sec["kv_token_bytes"] == cost.kv_token_bytes()
    for depth in DEPTHS:
        rows = [r for r in sec["rows"] if r["depth"] == depth]
        for r in rows:
            d = cost.per_token_read_bytes(r["batch"], r["mean_context"])
            assert r["formula_bytes_per_token"] == pytest.approx(d)
            assert r["engine_bytes_per_token"] == pytest.approx(d)         # every step held all b requests
            assert r["achieved_bytes_per_s"] == pytest.approx(r["engine_bytes_per_token"] * r["tok_s"])
        per_token = [r["formula_bytes_per_token"] for r in rows]
        assert all(a > b for a, b in itertools.pairwise(per_token))
        assert rows[0]["vs_batch1"] == 1.0
        assert all(r["vs_batch1"] == pytest.approx(r["tok_s"] / rows[0]["tok_s"]) for r in rows)


def test_json_round_trips_and_renders(doc):
    again = json.loads(json.dumps(doc))
    assert again == doc
    text = render_table(again)
    assert "batch scaling (KV f16, 4 tokens per request" in text and "D_w/b + L·k" in text
    table = text.split("batch scaling", 1)[1].splitlines()[2:]
    assert len(table) == len(DEPTHS) * len(BATCHES)


def test_a_partly_filled_step_reads_more_than_the_formula(cost):
    # two requests decode, then one alone: the lone step reads D_w for one token
    row = batch_row(cost, "f16", batch=2, depth=9, tokens=5, decode_steps=[[10, 10], [11]], prefill_s=0.1,
                    decode_s=0.3, executor_s=0.2, request_tok_s=5.0)
    assert row["decode_tokens"] == 3 and row["mean_context"] == pytest.approx(31 / 3)
    extra = row["engine_bytes_per_token"] - row["formula_bytes_per_token"]
    assert extra == pytest.approx(cost.decode_read_bytes(1) / 6)
    assert row["tok_s"] == pytest.approx(10.0) and row["step_overhead"] == pytest.approx(1 / 3)


def test_without_batch_sizes_the_section_is_null(default_model):
    spec = ModelSpec.from_gguf(str(default_model))
    d = results(str(default_model), spec, "llama.cpp", "x", {}, [], "here", None)
    assert "batch_scaling" in d and d["batch_scaling"] is None


def test_measure_frees_every_cell_and_checks_its_arguments(default_model, cost):
    from localinfer.backends.engine import LoadPlan
    from localinfer.loadgen.batch_scaling import batch_plan, measure_batch, measure_batch_scaling
    from localinfer.backends.llamacpp.executor import LlamaCppExecutor

    plan = batch_plan(LoadPlan(str(default_model), n_threads=1, flash_attn=True), (3,), (5,), 3)
    assert plan.n_seq == 3 and plan.n_ctx == 3 * 256 and plan.options["kv_unified"] is False
    with LlamaCppExecutor(plan) as ex:
        row = measure_batch(ex, cost, "f16", 3, 5, 3)
        assert row["tokens"] == 9 and ex.cells_used() == 0
        with pytest.raises(ValueError, match="2 tokens"):
            measure_batch_scaling(ex, cost, "f16", (1,), (5,), 1)
        with pytest.raises(ValueError, match="slots"):
            measure_batch_scaling(ex, cost, "f16", (4,), (5,), 3)


@pytest.mark.parametrize("argv,text", [
    (["--batch-sizes", "0"], "1..256"),
    (["--batch-sizes", "2", "--gen", "1"], "--gen 2"),
    (["--batch-sizes", "2", "--backend", "torch"], "llama.cpp serving engine"),
])
def test_bad_batch_options_are_refused_before_loading(capsys, argv, text):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert text in err and "loading" not in err
