"""`inspect`, `fit` and the planning modules never import torch, llama_cpp or mlx.

Runs in a fresh interpreter (the test process itself may have imported anything).
Modules are discovered by globbing, so ones added later are checked too; only the
backend modules, which may import their backend lazily, are exempt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("torch", "llama_cpp", "mlx", "mlx_lm", "cuda_backend")
BACKEND_MODULES = {"llamacpp", "llamacpp_native", "llamacpp_vocab", "runner", "chat", "mlx_backend"}      # may import a backend, lazily
PLANNING_COMMANDS = ("inspect", "skeleton", "fit", "devices", "plan", "report")

_PROBE = r"""
import contextlib, importlib, io, json, sys
forbidden = FORBIDDEN
def leaked():
    return sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
out = {"errors": {}}
for name in MODULES:
    try:
        importlib.import_module(name)
    except Exception as exc:
        out["errors"][name] = f"{type(exc).__name__}: {exc}"
out["after_imports"] = leaked()
from localinfer.cli import main
out["commands"] = {}
for argv in COMMANDS:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    out["commands"][" ".join(argv[:1])] = rc
out["after_commands"] = leaked()
print(json.dumps(out))
"""


def planning_modules() -> list[str]:
    """Every gguf_tools and localinfer module and planning command, minus the backend modules."""
    mods = [f"gguf_tools.{p.stem}" for p in sorted((ROOT / "gguf_tools").glob("*.py")) if p.stem != "__init__"]
    for p in sorted((ROOT / "localinfer").glob("*.py")):
        if p.stem in ("__init__", "__main__") or p.stem in BACKEND_MODULES or p.stem.startswith("mlx_backend"):
            continue
        mods.append(f"localinfer.{p.stem}")
    for name in PLANNING_COMMANDS:
        if (ROOT / "localinfer" / "commands" / f"{name}.py").exists():
            mods.append(f"localinfer.commands.{name}")
    return ["gguf_tools", "localinfer", *mods]


def _probe(modules: list[str], commands: list[list[str]]) -> dict:
    code = (_PROBE.replace("FORBIDDEN", repr(FORBIDDEN)).replace("MODULES", repr(modules))
            .replace("COMMANDS", repr(commands)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_discovery_finds_the_core_modules():
    mods = planning_modules()
    for name in ("gguf_tools.reader", "gguf_tools.skeleton", "gguf_tools.inspect", "localinfer.model.spec",
                 "localinfer.units", "localinfer.errors", "localinfer.model.sources", "localinfer.backends.engine",
                 "localinfer.backends.registry", "localinfer.generate.decoding", "localinfer.commands.inspect"):
        assert name in mods
    assert "localinfer.backends.llamacpp.engine" not in mods


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory) -> Path:
    from gguf_tools.skeleton import write_skeleton

    return write_skeleton("qwen3-8b", tmp_path_factory.mktemp("hyg") / "q.gguf", type="q4_0")


def test_planning_modules_and_commands_import_no_backend(skeleton):
    commands = [["inspect", str(skeleton)], ["inspect"], ["skeleton", "--list"]]
    for name in ("fit", "devices", "plan", "report"):
        if (ROOT / "localinfer" / "commands" / f"{name}.py").exists():
            commands.append([name, str(skeleton)] if name != "devices" else [name])
    out = _probe(planning_modules(), commands)
    assert out["commands"]["inspect"] == 0
    if out["after_imports"] or out["after_commands"]:
        culprits = {}
        for mod in planning_modules():
            leaked = _probe([mod], [])["after_imports"]
            if leaked:
                culprits[mod] = leaked[:3]
        pytest.fail(f"backend modules imported: at import {out['after_imports'][:5]}, by commands "
                    f"{out['after_commands'][:5]}; importers: {culprits}")
    assert not out["errors"], out["errors"]
