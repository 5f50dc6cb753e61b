"""Agent frameworks and API clients against `localinfer serve`: which features each one gets served.

    python -m benchmarks.agent_clients [--json out.json] [--port N]

Starts ``localinfer serve`` on the default model (SmolLM2-135M: a tiny model, so an agent loop rarely reaches a
good answer; what is checked is that every request the framework sends by default is *served*: no HTTP error,
replies in the shapes the client parses), then runs each case and prints a pass/fail table:

- the ``openai`` client: chat text, tools (required), response_format, tools + response_format (``parse``),
  Responses text, Responses function tools with a ``function_call_output`` turn, Responses ``text.format``;
- openai-agents (Responses model, its default; and the Chat Completions model): an Agent with a function tool and
  an ``output_type``;
- pydantic-ai (chat model): an Agent with a tool and ``NativeOutput``;
- the ``ollama`` client: chat with tools, ``format`` with a schema;
- the ``ai`` SDK with ``@ai-sdk/openai-compatible`` under node, when ``--node-dir DIR`` (default: the checkout)
  has them in its ``node_modules`` (``npm install ai @ai-sdk/openai-compatible zod`` there; this script installs
  nothing).

A framework whose package is missing is reported as skipped.  A case passes when the client got a reply it
accepted; an agent run that ends in the framework's own "the model did not produce valid output" / turn-limit
error (a 135M model writing poor JSON) passes as *served* and is marked so; any HTTP error fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
ASK = "What is the weather in Oslo? Answer with the city and the temperature in celsius."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", "--port", str(port), "--parallel", "2",
                          "--ctx", "4096", "--default-max-tokens", "96"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import httpx

    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    p.kill()
    raise SystemExit(f"serve did not come up: {p.stderr.read()[-500:]}")


# ---- the cases ---------------------------------------------------------------------------------------------

def openai_cases(base: str):
    import openai
    import pydantic

    c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}

    class Answer(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        celsius: int = pydantic.Field(ge=-60, le=60)

    def chat_text():
        return bool(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8).choices[0].message.content)

    def chat_tools():
        ch = c.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], tools=[tool],
                                       tool_choice="required", max_tokens=60).choices[0]
        return bool(ch.message.tool_calls)

    def chat_format():
        r = c.chat.completions.parse(model="m", messages=[{"role": "user", "content": ASK}], response_format=Answer,
                                     max_tokens=60, temperature=0)
        return r.choices[0].message.parsed is not None

    def chat_tools_and_format():
        r = c.chat.completions.parse(model="m", messages=[{"role": "user", "content": ASK}], response_format=Answer,
                                     tools=[openai.pydantic_function_tool(Answer, name="get_weather")],
                                     max_tokens=60, temperature=0)
        m = r.choices[0].message
        return bool(m.tool_calls) or m.parsed is not None

    def responses_text():
        return bool(c.responses.create(model="m", input="hi", max_output_tokens=8).output_text)

    def responses_tools():
        t = {"type": "function", "name": "get_weather", "parameters": WEATHER}
        r = c.responses.create(model="m", input=ASK, tools=[t], tool_choice="required", max_output_tokens=40)
        call = next(o for o in r.output if o.type == "function_call")
        r2 = c.responses.create(model="m", previous_response_id=r.id, tools=[t], max_output_tokens=16,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}])
        return r2.status in ("completed", "incomplete")

    def responses_format():
        r = c.responses.create(model="m", input=ASK, max_output_tokens=60, temperature=0,
                               text={"format": {"type": "json_schema", "name": "answer",
                                                "schema": Answer.model_json_schema()}})
        return r.output_text.lstrip().startswith("{")

    return [("openai", "chat text", chat_text), ("openai", "chat tools required", chat_tools),
            ("openai", "chat response_format (parse)", chat_format),
            ("openai", "chat tools + response_format (parse)", chat_tools_and_format),
            ("openai", "responses text", responses_text), ("openai", "responses function tools, 2 turns", responses_tools),
            ("openai", "responses text.format json_schema", responses_format)]


def agents_cases(base: str):
    import agents
    import pydantic
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)

    class Answer(pydantic.BaseModel):
        city: str
        celsius: int

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return "12 degrees celsius"

    def run(model) -> str:
        agent = agents.Agent(name="weather", instructions="Use the tool, then answer.", tools=[get_weather],
                             output_type=Answer, model=model,
                             model_settings=agents.ModelSettings(max_tokens=80))
        try:
            res = agents.Runner.run_sync(agent, ASK, max_turns=3)
            return "ok" if isinstance(res.final_output, Answer) else "served"
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):
            return "served"

    return [("openai-agents", "Agent + tool + output_type (Responses model)",
             lambda: run(agents.OpenAIResponsesModel(model="m", openai_client=client))),
            ("openai-agents", "Agent + tool + output_type (Chat Completions model)",
             lambda: run(agents.OpenAIChatCompletionsModel(model="m", openai_client=client)))]


def pydantic_ai_cases(base: str):
    import pydantic
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    class Answer(pydantic.BaseModel):
        city: str
        celsius: int

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=base, api_key="unused"))

    def run() -> str:
        agent = Agent(model, output_type=NativeOutput(Answer), instructions="Use the tool, then answer.",
                      model_settings={"max_tokens": 80})

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """The weather now in a city."""
            return "12 degrees celsius"

        try:
            res = agent.run_sync(ASK, usage_limits=UsageLimits(request_limit=4))
            return "ok" if isinstance(res.output, Answer) else "served"
        except (UnexpectedModelBehavior, UsageLimitExceeded):
            return "served"

    return [("pydantic-ai", "Agent + tool + NativeOutput (chat model)", run)]


def ollama_cases(url: str):
    import ollama

    c = ollama.Client(host=url, timeout=120)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                              "parameters": WEATHER}}

    def tools():
        r = c.chat(model="m", messages=[{"role": "user", "content": ASK}], tools=[tool], options={"num_predict": 60})
        return r.done

    def fmt():
        r = c.chat(model="m", messages=[{"role": "user", "content": ASK}], format=WEATHER,
                   options={"num_predict": 60, "temperature": 0})
        return r.message.content.lstrip().startswith("{")

    return [("ollama", "chat tools", tools), ("ollama", "chat format (schema)", fmt)]


AI_SDK = r"""
const { createOpenAICompatible } = require('@ai-sdk/openai-compatible');
const { generateText, Output, tool } = require('ai');
const { z } = require('zod');
const p = createOpenAICompatible({ name: 'local', baseURL: process.argv[1], apiKey: 'unused' });
(async () => {
  const r = await generateText({ model: p('m'), prompt: 'What is the weather in Oslo?', maxOutputTokens: 80,
    tools: { get_weather: tool({ description: 'Weather now', inputSchema: z.object({ city: z.string() }),
                                 execute: async () => '12 degrees' }) },
    experimental_output: Output.object({ schema: z.object({ city: z.string(), celsius: z.number() }) }) });
  console.log(JSON.stringify({ ok: true, finish: r.finishReason }));
})().catch(e => { console.log(JSON.stringify({ ok: false, error: String(e).slice(0, 200) })); process.exit(1); });
"""


def ai_sdk_cases(base: str, where: Path = ROOT):
    mods = where / "node_modules"
    if not ((mods / "ai").is_dir() and (mods / "@ai-sdk" / "openai-compatible").is_dir() and (mods / "zod").is_dir()):
        raise ImportError("node_modules lacks ai, @ai-sdk/openai-compatible or zod")

    def run():
        out = subprocess.run(["node", "-e", AI_SDK, base], capture_output=True, text=True, timeout=180, cwd=where)
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        if not doc["ok"] and "NoObjectGenerated" in doc.get("error", ""):
            return "served"
        if not doc["ok"]:
            raise RuntimeError(doc["error"])
        return True

    return [("ai SDK (node)", "generateText + tool + Output.object", run)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--node-dir", type=Path, default=ROOT, help="a folder whose node_modules has the ai SDK")
    args = ap.parse_args(argv)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    base = url + "/v1"
    proc = start(port)
    rows = []
    try:
        for build, arg in ((openai_cases, base), (agents_cases, base), (pydantic_ai_cases, base),
                           (ollama_cases, url), (ai_sdk_cases, base)):
            try:
                cases = build(arg, args.node_dir) if build is ai_sdk_cases else build(arg)
            except ImportError as exc:
                rows.append((build.__name__.removesuffix("_cases"), "(all)", "skipped", str(exc)[:80], 0.0))
                continue
            for client, feature, fn in cases:
                t = time.monotonic()
                try:
                    got = fn()
                    verdict = "pass" if got in (True, "ok") else "pass (served)" if got == "served" else "FAIL"
                    note = "" if got in (True, "ok", "served") else f"returned {got!r}"
                except Exception as exc:  # noqa: BLE001 - a failing case is a row of the table
                    verdict, note = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append((client, feature, verdict, note, time.monotonic() - t))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"{'client':<15} {'feature':<52} {'verdict':<14} {'s':>5}  note")
    for client, feature, verdict, note, s in rows:
        print(f"{client:<15} {feature:<52} {verdict:<14} {s:5.1f}  {note}")
    failed = sum(r[2] == "FAIL" for r in rows)
    print(f"{len(rows)} cases, {failed} failed")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("client", "feature", "verdict", "note", "seconds"), r))
                                               for r in rows], indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
