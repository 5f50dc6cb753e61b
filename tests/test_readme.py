"""The README's Python example runs as written, and its quickstart names the commands CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "fits" in out and len(out.splitlines()) >= 2


def test_quickstart_is_two_commands_and_ci_runs_the_second():
    block = re.search(r"## Quickstart\n\n```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(block) == 2
    assert "localinfer fit" in block[0]
    assert block[1] in (ROOT / ".ci" / "run").read_text()
