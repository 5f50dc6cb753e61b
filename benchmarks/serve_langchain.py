"""LangChain's ChatOpenAI, OpenAI and OpenAIEmbeddings against localinfer serve (needs langchain-openai; not in the
test extra): python3 benchmarks/serve_langchain.py; results in benchmarks/results/serve_clients_cpu.txt."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from localinfer.model.sources import resolve_model
from tests.serve.test_http_support import LiveServer

srv = LiveServer(resolve_model(None), ctx=1024)
try:
    from langchain_openai import ChatOpenAI, OpenAI, OpenAIEmbeddings
    chat = ChatOpenAI(base_url=srv.base_url, api_key="x", max_tokens=8, temperature=0, max_retries=0)
    print("ChatOpenAI default model", chat.model_name, "->", repr(chat.invoke("Name a colour.").content))
    print("ChatOpenAI stream ->", repr("".join(c.content for c in chat.stream("Name a colour."))))
    llm = OpenAI(base_url=srv.base_url, api_key="x", max_tokens=6, temperature=0, max_retries=0)
    print("OpenAI default model", llm.model_name, "batch ->", llm.batch(["The capital of France is", "One, two,"]))
    res = llm.generate(["The sky is", "def add(a, b):", "Once upon"])
    print("OpenAI.generate ->", [g[0].text for g in res.generations])
    emb = OpenAIEmbeddings(base_url=srv.base_url, api_key="x", check_embedding_ctx_length=False, max_retries=0)
    v = emb.embed_documents(["a cat", "a dog"])
    q = emb.embed_query("a cat")
    print("OpenAIEmbeddings default model", emb.model, "->", len(v), len(v[0]), "query dims", len(q))
    try:
        emb2 = OpenAIEmbeddings(base_url=srv.base_url, api_key="x", max_retries=0)
        emb2.embed_documents(["a cat"])
        print("OpenAIEmbeddings with tiktoken: ok")
    except Exception as e:  # noqa: BLE001 - whatever the client raises is the finding
        print("OpenAIEmbeddings default (tiktoken ctx check):", type(e).__name__, str(e)[:120])
finally:
    srv.stop()
