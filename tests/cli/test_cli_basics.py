"""The `localinfer` entry point: help, version, and one-line errors without tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localinfer import __version__
from localinfer.cli import COMMANDS, main

ENV = {**os.environ, "LOCALINFER_DEBUG": ""}


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["localinfer", *argv], capture_output=True, text=True, timeout=60, env=ENV)


def _one_error_line(stderr: str) -> str:
    """The error block: optional argparse usage, exactly one `error:` line, optional hint."""
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, stderr
    others = [ln for ln in lines if ln not in errors]
    assert all(ln.startswith(("usage:", "hint:", " ")) for ln in others), stderr
    return errors[0]


def test_help_lists_every_command():
    proc = _run("--help")
    assert proc.returncode == 0 and not proc.stderr
    for name in COMMANDS:
        assert name in proc.stdout


def test_version():
    proc = _run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"localinfer {__version__}"


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "localinfer", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_unknown_command():
    proc = _run("frobnicate")
    assert proc.returncode == 2
    assert "frobnicate" in _one_error_line(proc.stderr)


def test_missing_model_file():
    proc = _run("inspect", "/nonexistent/model.gguf")
    assert proc.returncode != 0 and not proc.stdout
    assert "/nonexistent/model.gguf" in _one_error_line(proc.stderr)
    assert "hint:" in proc.stderr


def test_no_arguments_prints_help(capsys):
    assert main([]) == 0
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize("argv, code", [
    (["inspect", "--bogus"], 2),
    (["inspect", "a.gguf", "b.gguf"], 2),
    (["skeleton"], 2),
    (["skeleton", "no-such-preset", "-o", "/tmp/never.gguf"], 2),
    (["inspect", "/"], 3),
])
def test_usage_errors_in_process(capsys, argv, code):
    try:
        rc = main(argv)
    except SystemExit as exc:                          # argparse's own errors
        rc = exc.code
    assert rc == code
    _one_error_line(capsys.readouterr().err)


def test_debug_shows_the_traceback():
    proc = subprocess.run(["localinfer", "inspect", "/nonexistent/model.gguf"], capture_output=True, text=True,
                          timeout=60, env={**ENV, "LOCALINFER_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ModelNotFoundError" in proc.stderr


def test_sigterm_during_generation_exits_cleanly(default_model):
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "localinfer", "run", "--raw", "-p", "Once upon a time", "-n", "2000",
         "--ignore-eos", "-t", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(4)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "terminated" in err
