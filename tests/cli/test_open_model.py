"""fit, plan, report and replay open MODEL through generation.load.open_model, as run and chat do."""

from __future__ import annotations

from pathlib import Path

import pytest

from localinfer.cli import main
from localinfer.generation import load

TRACE = Path(__file__).resolve().parents[1] / "serve" / "data" / "chapter_trace.json"
ARGV = {
    "fit": ["fit", "{m}", "--device", "h200"],
    "plan": ["plan", "{m}", "--device", "h200"],
    "report": ["report", "{m}", "--devices", "h200"],
    "replay": ["replay", str(TRACE), "--model", "{m}", "--device", "h200"],
}


@pytest.mark.parametrize("cmd", sorted(ARGV))
def test_every_planning_command_opens_the_model_once_through_open_model(cmd, monkeypatch, capsys, default_model):
    seen = []
    real = load.open_model

    def spy(model=None, backend=None):
        seen.append(model)
        return real(model, backend)

    monkeypatch.setattr(load, "open_model", spy)
    assert main([a.format(m=default_model) for a in ARGV[cmd]] + (["--json"] if cmd != "report" else [])) == 0
    capsys.readouterr()
    assert seen == [str(default_model)]


@pytest.mark.parametrize("cmd", sorted(ARGV))
def test_a_directory_is_refused_as_run_refuses_it(cmd, capsys, tmp_path):
    assert main(["run", str(tmp_path), "-p", "hi"]) != 0
    want = capsys.readouterr().err
    assert main([a.format(m=tmp_path) for a in ARGV[cmd]]) != 0
    assert capsys.readouterr().err == want and "is a directory" in want
