"""/v1/embeddings through the `openai` client: llama.cpp's pooling on a context of its own, batched, float and
base64 (issue 32 item 12)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def test_embeddings_are_unit_vectors_the_same_alone_or_batched(client, srv):
    texts = ["The cat sat on the mat.", "A dog barked.", "Quarterly revenue grew by four percent."]
    r = client.embeddings.create(model="text-embedding-3-small", input=texts)
    assert r.model == "smollm2" and [d.index for d in r.data] == [0, 1, 2]
    m = np.array([d.embedding for d in r.data])
    assert m.shape[1] >= 64 and np.allclose(np.linalg.norm(m, axis=1), 1.0, atol=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 3
    alone = np.array(client.embeddings.create(model="m", input=texts[1]).data[0].embedding)
    assert np.allclose(alone, m[1], atol=2e-3)                # batching does not change a vector
    assert not np.allclose(m[0], m[2], atol=1e-2)
    ids = srv.runtime.tokenizer.tokenize(texts[1], add_bos=True, special=False)
    by_ids = np.array(client.embeddings.create(model="m", input=[ids]).data[0].embedding)
    assert np.allclose(by_ids, alone, atol=2e-3)
    raw = httpx.post(srv.base_url + "/embeddings", json={"model": "m", "input": texts[1],
                                                         "encoding_format": "base64"}, timeout=60).json()
    b64 = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(b64, alone, atol=2e-3)
    # the openai client asks for base64 and decodes it itself when no format is given: same vectors
    assert srv.metrics()["localinfer_kv_blocks_used"] == 0  # generation's cells untouched


def test_embedding_requests_bad_input_is_a_400(srv):
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for body, param in (({"model": "m", "input": ""}, "input"), ({"model": "m", "input": []}, "input"),
                            ({"model": "m", "input": [1.5]}, "input"), ({"model": "m"}, "input"),
                            ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
                            ({"model": "m", "input": "x", "dimensions": 3}, "dimensions"),
                            ({"model": "m", "input": [[10 ** 9]]}, "input"),
                            ({"model": "m", "input": "word " * 5000}, "input")):
            r = c.post("/embeddings", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert c.post("/embeddings", json={"model": "m", "input": "fine"}).status_code == 200


def test_a_small_request_is_not_held_behind_a_large_one(srv):
    """The engine thread embeds one turn (the step's token budget) at a time, requests in turn: a one-input
    request sent while a 4-input one runs is answered first (before, the large request's whole batch ran first)."""
    import threading
    import time

    big = [[100 + k] * 300 for k in range(4)]          # 4 turns of one 300-token input (the 512-token budget)
    done: dict[str, float] = {}

    def post(name, body):
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            r = c.post("/embeddings", json=body)
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()
        if name == "big":
            vectors = [d["embedding"] for d in r.json()["data"]]
            assert len(vectors) == 4 and len({round(v[0], 5) for v in vectors}) > 1   # in order, each its own

    t = threading.Thread(target=post, args=("big", {"model": "m", "input": big}))
    t.start()
    deadline = time.monotonic() + 30
    while not srv.app.state.server.embeddings.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert srv.app.state.server.embeddings.pending(), "the large request never reached the engine"
    post("small", {"model": "m", "input": "A dog barked."})
    t.join(120)
    assert done["small"] < done["big"], done
