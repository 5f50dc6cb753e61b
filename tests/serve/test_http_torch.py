"""`localinfer serve --backend torch`: the OpenAI server on the torch paged executor (embedded model, torch on the
CPU, 1 thread), through the real `openai` client.

The server opens its executor as the command does (``commands.serve._executor_factory``: the plan fit checked,
the pool ``fit --backend torch`` counts, the executor's block size), and the block manager takes prefix hits from
the pool (``restores_cached_prefix``), so a repeated prompt is read from blocks no request holds any more.  With
``--lookup`` the greedy text equals the plain server's.  ``serve --backend mlx`` is refused in one line.
Outputs are short: torch on the CPU runs this 30-layer model at a few tokens a second per thread.
"""

from __future__ import annotations

import re
import signal

import pytest

from tests.serve.test_http_support import MODEL_ID, LiveServer, start_cli

pytest.importorskip("torch")
pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

COPY = ("Copy the list exactly.\nList: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\n"
        "Copy: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\n"
        "List: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy:")


def torch_server(model, *, parallel: int = 2, ctx: int = 512, **serve) -> LiveServer:
    """A LiveServer on the torch executor, opened by the command's own factory over the plan it fit checks."""
    from localinfer.backends.engine import LoadPlan
    from localinfer.commands.serve import _executor_factory

    plan = LoadPlan(str(model), n_ctx=ctx, n_seq=parallel, n_threads=1, n_gpu_layers=0)
    return LiveServer(model, parallel=parallel, max_queue=4, ctx=ctx,
                      open_executor=lambda config: _executor_factory("torch", plan, parallel), **serve)


@pytest.fixture(scope="module")
def torch_srv(default_model):
    srv = torch_server(default_model)
    yield srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)


def test_serves_on_the_torch_executor_with_prefix_hits_from_the_pool(torch_srv):
    from cuda_backend.paged_executor import PagedExecutor

    rt = torch_srv.runtime
    inner = rt.executor.inner
    assert isinstance(inner, PagedExecutor) and inner.n_slots == 2
    assert rt.engine.blocks.pool_hits and rt.engine.blocks.block_tokens == inner.block_size
    assert rt.engine.blocks.num_blocks == inner.pool.num_blocks == 2 * -(-256 // inner.block_size)   # fit's pool
    assert rt.context_tokens == 512
    from localinfer.backends.engine import LoadPlan
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.fit import check_load

    path = inner.spec.path
    fit = check_load(ModelSpec.from_gguf(path), LoadPlan(path, n_ctx=512, n_seq=2, n_gpu_layers=0), backend="torch")
    assert fit.fits and inner.pool.nbytes == fit.breakdown.kv       # the bytes `fit --backend torch` counts
    messages = [{"role": "user", "content": "Name three colours."}]
    with _client(torch_srv) as c:
        first = c.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=6)
        again = c.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=6)
    assert first.choices[0].message.content and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 6 and first.usage.prompt_tokens > 16
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens     # read from the pool: the first request is done
    assert cached == (first.usage.prompt_tokens - 1) // 16 * 16 and cached > 0
    m = torch_srv.wait_idle()
    assert m["localinfer_kv_blocks_used"] == 0 and m["localinfer_prefix_cache_hit_tokens_total"] >= cached


def _serve_cli(*flags):
    return start_cli("--backend", "torch", "-t", "1", "--ctx", "512", "--parallel", "2", *flags, timeout=90)


def test_the_command_with_lookup_gives_the_plain_servers_greedy_text(torch_srv):
    with _client(torch_srv) as c:
        plain = c.completions.create(model=MODEL_ID, prompt=COPY, temperature=0, max_tokens=16)
    p, url = _serve_cli("--lookup")
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            model = c.models.list().data[0].id
            spec = c.completions.create(model=model, prompt=COPY, temperature=0, max_tokens=16)
        text = httpx.get(url + "/metrics", timeout=10).text
        accepted = float(re.search(r"^localinfer_spec_accepted_tokens_total (\S+)$", text, re.MULTILINE).group(1))
    finally:
        p.send_signal(signal.SIGTERM)
        code = p.wait(30)
    err = p.stderr.read()
    assert code == 0 and "Traceback" not in err and "error" not in err
    assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 16
    assert accepted > 0


def test_serve_refuses_mlx_in_one_line(capsys):
    from localinfer.cli import main

    code = main(["serve", "--backend", "mlx", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "backend 'mlx' has none yet" in err and len(err.strip().splitlines()) <= 2   # the error and its hint


def test_a_torch_plan_that_does_not_fit_is_refused_before_binding(capsys, tmp_path):
    from gguf_tools.skeleton import write_skeleton
    from localinfer.cli import main

    big = write_skeleton("qwen3-8b", tmp_path / "big.gguf")     # header only, sparse; f32 on this CPU: 32 GB
    code = main(["serve", str(big), "--backend", "torch", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: needs") and "hint:" in err and "serving" not in err


def test_structured_output_on_the_torch_executor(torch_srv):
    """The grammar masks apply on the torch executor's rows as on llama.cpp's (one tokenizer per vocabulary)."""
    pytest.importorskip("llguidance")
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with _client(torch_srv) as c:
        r = c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Is it ok? JSON."}],
                                      max_tokens=12, temperature=0.7, seed=2,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "ok", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
        t = c.completions.create(model=MODEL_ID, prompt="Answer:", max_tokens=4, temperature=1.0, seed=1,
                                 extra_body={"choice": ["yes", "no"]})
        assert t.choices[0].text in ("yes", "no") and t.choices[0].finish_reason == "stop"
