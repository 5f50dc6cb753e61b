"""Structured output outside the server: `localinfer run --json-schema / --grammar`, chat `/schema`, and
`localinfer.generate(..., response_format=...)`, on the embedded model."""

from __future__ import annotations

import io
import json

import pytest

from localinfer.cli import main

pytest.importorskip("llguidance")
pytest.importorskip("llama_cpp")
jsonschema = pytest.importorskip("jsonschema")

FAST = ["-t", "1", "--ctx", "512"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "temp_c": {"type": "integer", "minimum": -50, "maximum": 50}},
          "required": ["city", "temp_c"], "additionalProperties": False}


def test_run_json_schema_and_grammar(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["run", "-p", "Weather in Oslo as JSON", "--json-schema", str(schema), "--temp", "0.8",
                 "--seed", "4", "--json", *FAST]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["finish_reason"] == "stop"
    jsonschema.validate(json.loads(doc["text"]), SCHEMA)
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no"\n')
    assert main(["run", "-p", "Is water wet?", "--grammar", str(lark), "--temp", "0", *FAST]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


@pytest.mark.parametrize("text,flag", [('{"type": "nope"}', "--json-schema"), ("not json", "--json-schema"),
                                       ("start: missing", "--grammar")])
def test_run_refuses_a_bad_file_before_loading(capsys, tmp_path, text, flag):
    f = tmp_path / "bad"
    f.write_text(text)
    assert main(["run", "-p", "x", flag, str(f), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err and "loading" not in err


def test_generate_with_response_format_and_chat_schema(tmp_path):
    from pydantic import BaseModel, Field

    import localinfer
    from localinfer.generation.api import _template
    from localinfer.generation.chat import ChatSession

    class Weather(BaseModel):
        city: str = Field(max_length=20)
        temp_c: int = Field(ge=-50, le=50)

    with localinfer.load(ctx=512, threads=1) as engine:
        for rf in (Weather, {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}):
            text = localinfer.generate(engine, [{"role": "user", "content": "Weather in Rome?"}], temperature=0,
                                       max_tokens=60, response_format=rf)
            jsonschema.validate(json.loads(text), SCHEMA)
        assert localinfer.generate(engine, "Pick one:", grammar='start: "red" | "blue"', temperature=0.7, seed=1,
                                   max_tokens=8) in ("red", "blue")
        schema = tmp_path / "s.json"
        schema.write_text(json.dumps(SCHEMA))
        out = io.StringIO()
        chat = ChatSession(engine, _template(engine), max_tokens=60, out=out)
        chat.command(f"/schema {schema}")
        chat.turn("Weather in Lima?")
        jsonschema.validate(json.loads(chat.messages[-1]["content"]), SCHEMA)
        chat.command("/schema -")
        chat.command(f"/schema {tmp_path / 'missing.json'}")
        assert "cannot read /schema file" in out.getvalue() and chat.grammar is None
