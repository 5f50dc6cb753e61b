"""Every architecture family runs through llama.cpp: greedy tokens equal llama.cpp's own decode of the same prompt
(llama-cpp-python's ``Llama.generate`` in a subprocess, 1 thread), ``run``/``bench`` work from the CLI, ``serve``
answers an OpenAI client, and the torch and MLX backends refuse with a line naming ``--backend llama.cpp``.

The files are tiny random-weight models of each layout (tests/support/tiny_archs.py), written the way llama.cpp's
converter writes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.ggufgen import write_tiny_arch
from tests.support.tiny_archs import TINY

pytest.importorskip("llama_cpp")

PROMPT = [40, 80, 120, 160, 200, 33, 66, 99, 7, 250]
N = 8
_REFERENCE = textwrap.dedent("""
    import json, sys
    import llama_cpp
    paths, prompt, n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    out = {}
    for path in paths:
        llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=1, n_batch=512, verbose=False)
        toks = []
        for t in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if len(toks) >= n or t == llm.token_eos():
                break
        out[path] = toks
        llm.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {name: str(write_tiny_arch(root / f"{name}.gguf", spec, seed=3)) for name, spec in TINY.items()}


@pytest.fixture(scope="module")
def reference(models) -> dict[str, list[int]]:
    """llama.cpp's greedy tokens for every model, one subprocess for all."""
    proc = subprocess.run([sys.executable, "-c", _REFERENCE, json.dumps(list(models.values())), json.dumps(PROMPT),
                           str(N)], capture_output=True, text=True, timeout=300, check=True)
    by_path = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: by_path[path] for name, path in models.items()}


@pytest.mark.parametrize("name", list(TINY))
def test_greedy_tokens_equal_llamacpp_own_decode(name, models, reference):
    import localinfer
    from localinfer.generation.sampling import SamplingParams

    engine = localinfer.load(models[name], ctx=512, threads=1)
    try:
        ours = [c.token for c in localinfer.Runner(engine).stream(list(PROMPT), SamplingParams(temperature=0, greedy=True),
                                                                  max_tokens=N) if c.token is not None]
    finally:
        engine.close()
    ref = reference[name]
    assert len(ours) >= 1 and ours == ref[:len(ours)], (ours, ref)
    assert len(ours) == len(ref)          # both stop at the same EOS or run to N


@pytest.mark.parametrize("name", ["qwen3next", "granitehybrid", "deepseek2-mla-q-lora", "glm4moe", "llama4"])
def test_run_and_bench_from_the_cli(name, models, capsys):
    from localinfer.cli import main

    code = main(["run", models[name], "-p", "Hello there", "--raw", "--temp", "0", "-n", "4", "--ignore-eos",
                 "--json", "-t", "1", "--ctx", "512"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["timings"]["generated_tokens"] == 4
    mem = doc["memory"]
    assert mem["weights"] > 0 and (mem["kv"] > 0)
    if name in ("qwen3next", "granitehybrid"):
        assert mem["state"] > 0               # llama.cpp's RS buffer, reported as its own kind
        row = doc["devices"][0]
        assert row["predicted"]["state"] > 0 and row["reported"]["state"] > 0
    if name in ("qwen3next", "deepseek2-mla-q-lora"):       # bench as a user runs it: its own process
        proc = subprocess.run([sys.executable, "-m", "localinfer", "bench", models[name], "-t", "1", "-c", "512",
                               "--kv", "f16", "--prompt-lengths", "32", "--depths", "0", "--gen", "4", "--repeats",
                               "1", "--json", "-"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-500:]
        run = json.loads(proc.stdout)["runs"][0]
        assert run["decode"] and run["prefill"]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_other_backends_refuse_naming_llamacpp(backend, models, capsys):
    from localinfer.cli import main

    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    code = main(["run", models["qwen35"], "--backend", backend, "-p", "hi", "-n", "2"])
    _, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in err
    assert "--backend llama.cpp" in err and len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1
    assert "--ctx" not in err and "--force" not in err      # no flag of the plan's would make it run


def test_fit_says_a_backend_cannot_run_the_architecture(models, capsys):
    from localinfer.cli import main

    code = main(["fit", models["deepseek2-mla-lite"], "--backend", "torch", "--device", "h200", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    dev = json.loads(out)["devices"][0]
    assert dev["fits"] is False and "--backend llama.cpp" in dev["reason"]


def test_serve_answers_a_hybrid_and_an_mla_model(models):
    openai = pytest.importorskip("openai")
    from tests.serve.test_http_support import LiveServer

    for name in ("qwen35", "deepseek2-mla-lite"):
        srv = LiveServer(models[name], parallel=2, ctx=1024)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0)
            texts = [client.completions.create(model="m", prompt="The sky is", max_tokens=6, temperature=0)
                     for _ in range(2)]
            assert texts[0].choices[0].text == texts[1].choices[0].text
            assert texts[0].usage.completion_tokens >= 1
        finally:
            srv.stop()


@pytest.mark.parametrize("name", ["qwen3next", "granitehybrid", "mamba2"])
def test_a_second_turn_on_a_recurrent_model_recomputes_and_equals_a_cold_run(name, models):
    """A recurrent state cannot be cut back to the shared prefix (the engine declares it: trims_tail), so the
    runner clears the sequence and prefills the whole prompt again; the reply equals a fresh engine's."""
    import localinfer
    from localinfer.generation.sampling import SamplingParams

    greedy = SamplingParams(temperature=0, greedy=True)
    first, second = list(PROMPT), list(PROMPT[:6]) + [11, 22, 33, 44]        # shares 6 tokens, then differs
    engine = localinfer.load(models[name], ctx=512, threads=1)
    try:
        assert engine.trims_tail is False
        runner = localinfer.Runner(engine)
        list(runner.stream(first, greedy, max_tokens=4))
        warm = [c.token for c in runner.stream(second, greedy, max_tokens=N) if c.token is not None]
    finally:
        engine.close()
    cold_engine = localinfer.load(models[name], ctx=512, threads=1)
    try:
        cold = [c.token for c in localinfer.Runner(cold_engine).stream(second, greedy, max_tokens=N)
                if c.token is not None]
    finally:
        cold_engine.close()
    assert warm == cold and warm
