"""`localinfer bench`: the versioned JSON results, the table, and argument checks."""

import json

import pytest

from localinfer.cli import main
from localinfer.generation.bench import SCHEMA, VERSION, BenchConfig, render_table

SMALL = ["--kv", "f16,q8_0", "--prompt-lengths", "8,24", "--depths", "0,16", "--gen", "4", "-t", "1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", *SMALL, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_json_schema(results):
    assert results["schema"] == SCHEMA and results["version"] == VERSION
    assert results["backend"]["name"] == "llama.cpp"
    assert 0 < results["model"]["decode_read_bytes"] <= results["model"]["weight_bytes"]  # tied embeddings: all
    assert results["settings"]["prompt_lengths"] == [8, 24] and results["settings"]["gen_tokens"] == 4
    assert [r["type_k"] for r in results["runs"]] == ["f16", "q8_0"]
    for run in results["runs"]:
        assert [p["tokens"] for p in run["prefill"]] == [8, 24]
        assert all(p["tok_s"] > 0 and p["seconds"] > 0 for p in run["prefill"])
        assert [d["depth"] for d in run["decode"]] == [0, 16]
        for d in run["decode"]:
            assert d["tokens"] == 4 and d["tok_s"] > 0 and d["ttft_s"] > 0
            assert d["itl_p50_s"] <= d["itl_p95_s"]
            assert d["tok_s"] == pytest.approx((d["tokens"] - 1) / d["seconds"])
            assert d["achieved_bytes_per_s"] == pytest.approx(d["read_bytes_per_token"] * d["tok_s"])
        assert run["memory"]["kv"] > 0 and run["peak_rss_bytes"] >= run["memory"]["weights"]
    f16, q8 = results["runs"]
    assert q8["memory"]["kv"] < f16["memory"]["kv"] and q8["kv_token_bytes"] * 64 == f16["kv_token_bytes"] * 34


def test_table_lists_every_measurement(results):
    text = render_table(results)
    assert "prefill tok/s" in text and "ITL p95" in text and "peak RSS" in text
    assert text.count("KV q8_0") == 4  # prefill row, two decode rows, memory row


def test_lookup_against_plain_and_the_clairvoyant_bound(tmp_path):
    out = tmp_path / "lookup.json"
    argv = ["bench", "--kv", "f16", "--prompt-lengths", "8", "--depths", "0", "--gen", "48", "-t", "1", "--lookup"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    lk = doc["runs"][0]["lookup"]
    assert lk["tokens"] == 48 and lk["tok_s"] > 0 and lk["plain_tok_s"] > 0
    assert lk["tokens_per_round"] > 1 and 0 < lk["acceptance"] <= 1  # the prompt repeats itself: drafts land
    cost = lk["verify_cost_s"]
    assert len(cost) == 17 and cost[0] > 0 and cost[-1] > cost[0]  # verifying 17 tokens costs more than 1
    assert lk["bound"] > 1
    assert "clairvoyant drafter would reach" in render_table(doc)


def test_context_sized_for_the_lengths():
    cfg = BenchConfig(prompt_lengths=(100,), depths=(0, 300), gen_tokens=32)
    assert cfg.n_ctx_needed == 512


@pytest.mark.parametrize("argv,text", [
    (["--gen", "0"], "--gen"),
    (["--repeats", "1000"], "--repeats"),
    (["--prompt-lengths", "100000"], "trained on"),
    (["--prompt-lengths", "0"], "at least 1"),
])
def test_bad_values_are_refused_before_loading(capsys, argv, text):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert text in err and "loading" not in err


@pytest.mark.parametrize("argv,text", [(["--kv", "f17"], "unknown KV type"), (["--depths", "a,b"], "comma-separated")])
def test_malformed_lists_are_usage_errors(capsys, argv, text):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2 and text in capsys.readouterr().err


@pytest.mark.parametrize("backend,packages", [("llama.cpp", ["llama-cpp-python"]), ("torch", ["torch"]),
                                              ("mlx", ["mlx", "mlx-lm"])])
def test_backend_version_names_the_installed_packages(backend, packages):
    from importlib import metadata

    from localinfer.commands.bench import _backend_version

    installed = []
    for name in packages:
        try:
            installed.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    assert _backend_version(backend) == (", ".join(installed) or "unknown")
    assert _backend_version("some-plugin") == "unknown"
