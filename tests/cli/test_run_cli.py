"""`localinfer run` through the CLI boundary, in-process: output streams, JSON, and bad input."""

import json

import pytest

from localinfer.cli import main

FAST = ["-t", "1", "--ctx", "512"]


def run(capsys, *argv):
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_reply_on_stdout_stats_on_stderr(capsys):
    code, out, err = run(capsys, "-p", "What is 2+2?", "--temp", "0", "-n", "8", *FAST)
    assert code == 0
    assert out.strip() and "tok/s" not in out
    assert "tokens" in err and "TTFT" in err


def test_json_is_one_object_and_greedy_is_deterministic(capsys):
    args = ["-p", "Name a colour.", "--temp", "0", "-n", "6", "--json", *FAST]
    code, out, _err = run(capsys, *args)
    assert code == 0
    doc = json.loads(out)
    assert doc["backend"] == "llama.cpp" and doc["finish_reason"] in ("stop", "length")
    t = doc["timings"]
    assert t["generated_tokens"] <= 6 and t["ttft_s"] > 0 and t["prompt_tokens"] > 5
    assert doc["decode"]["rounds"] >= 1 and doc["memory"]["weights"] > 0
    assert doc["sampling"]["temperature"] == 0 and doc["plan"]["n_ctx"] == 512
    assert json.loads(run(capsys, *args)[1])["text"] == doc["text"]


def test_raw_skips_the_template_and_file_prompts(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is")
    code, out, _ = run(capsys, "-f", str(f), "--raw", "--temp", "0", "-n", "3", "--json", "--ignore-eos", *FAST)
    doc = json.loads(out)
    assert code == 0 and doc["timings"]["prompt_tokens"] == 5 and doc["timings"]["generated_tokens"] == 3
    assert "Paris" in doc["text"]


def test_lookup_stats_in_json(capsys):
    pytest.importorskip("localinfer.generation.lookup")
    text = "a b c d e f g h i j k l. a b c d e f g h i j k l. a b c d e f"
    code, out, _ = run(capsys, "-p", text, "--raw", "--temp", "0", "-n", "8", "--ignore-eos", "--lookup",
                       "--draft-max", "4", "--json", *FAST)
    doc = json.loads(out)
    assert code == 0 and doc["lookup"] is True and doc["decode"]["drafted"] > 0


@pytest.mark.parametrize("argv,flag_text", [
    (["-p", "x", "--temp", "nan"], "temperature"),
    (["-p", "x", "--temp", "-1"], "temperature"),
    (["-p", "x", "--top-p", "7"], "top_p"),
    (["-p", "x", "-n", "1000000000"], "max_tokens"),
    (["-p", "x", "-n", "0"], "max_tokens"),
    (["-p", "x", "--seed", "-4"], "seed"),
    (["-p", "x", "--ctx", "0"], "--ctx"),
    (["-p", "x", "--ctx", "99999999"], "--ctx"),
    (["-p", "x", "--backend", "nope"], "unknown backend"),
    (["-p", "x", "--draft-max", "4"], "--lookup"),
    (["-f", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["-p", "x", "--raw", "--system", "be nice"], "--system"),
])
def test_bad_arguments_give_one_line_errors(capsys, argv, flag_text):
    code, _out, err = run(capsys, *argv, "-t", "1")
    assert code == 2
    assert flag_text in err and "Traceback" not in err
    assert err.startswith("error: ")


def test_missing_model_and_not_a_model(capsys, tmp_path):
    code, _, err = run(capsys, str(tmp_path / "missing.gguf"), "-p", "x")
    assert code == 1 and "model file not found" in err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 64)
    code, _, err = run(capsys, str(junk), "-p", "x")
    assert code != 0 and err.startswith("error: ") and "Traceback" not in err


def test_prompt_longer_than_the_context(capsys):
    code, _, err = run(capsys, "-p", "word " * 400, "--raw", "-t", "1", "--ctx", "256")
    assert code == 1 and "context" in err and "hint:" in err


def test_chat_template_override_and_template_errors(capsys, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ raise_exception('only assistants may speak') }}")
    code, _, err = run(capsys, "-p", "x", "--chat-template", str(tpl), *FAST)
    assert code == 1 and "only assistants may speak" in err
    tpl.write_text("{{ ''.__class__.__mro__ }}")
    code, _, err = run(capsys, "-p", "x", "--chat-template", str(tpl), *FAST)
    assert code == 1 and "sandbox" in err


def test_a_model_that_does_not_fit_is_refused_before_loading(capsys, tmp_path):
    from gguf_tools.skeleton import write_skeleton

    big = write_skeleton("qwen3-235b-a22b", tmp_path / "big.gguf")  # header only, sparse data
    code, out, err = run(capsys, str(big), "-p", "hi", "-t", "1")
    assert code == 1 and out == ""
    assert err.startswith("error: needs") and "usable" in err and "hint:" in err and "--force" in err


def test_a_registered_plugin_backend_gets_the_same_command(capsys):
    import importlib.util
    from pathlib import Path

    from localinfer.backends import registry as backends

    path = Path(__file__).resolve().parents[2] / "examples" / "custom_backend.py"
    spec = importlib.util.spec_from_file_location("custom_backend_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    backends.register("bigram", module.BigramEngine)
    code, out, _ = run(capsys, "--backend", "bigram", "--raw", "-p", "the ", "-n", "12", "--seed", "2",
                       "--ignore-eos", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["backend"] == "bigram"
    assert doc["timings"]["generated_tokens"] == 12 and len(doc["text"].encode()) == 12
