"""serve/ imports only the layers below it (never torch, llama_cpp or mlx at module level); plan/ never serve/."""

import ast
import subprocess
import sys
from pathlib import Path

import localinfer

ROOT = Path(localinfer.__file__).parent
ALLOWED = ("localinfer.serve", "localinfer.backends.engine", "localinfer.backends.executor", "localinfer.generation",
           "localinfer.plan.paging", "localinfer.plan.speed", "localinfer.plan.speculation", "localinfer.model", "localinfer.util", "localinfer.errors", "localinfer.units")
HEAVY = ("torch", "llama_cpp", "mlx")


def _module_level_imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def _all_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_serve_imports_only_lower_layers():
    for path in sorted((ROOT / "serve").glob("*.py")):
        for name in _module_level_imports(path):
            assert not name.split(".")[0] in HEAVY, f"{path.name} imports {name} at module level"
            if name.startswith("localinfer"):
                assert name.startswith(ALLOWED), f"{path.name} imports {name}"


def test_plan_never_imports_serve():
    for path in sorted((ROOT / "plan").glob("*.py")):
        assert not any(n.startswith("localinfer.serve") for n in _all_imports(path)), path.name


def test_files_stay_small():
    for path in [*(ROOT / "serve").glob("*.py"), ROOT / "commands" / "replay.py", ROOT / "plan" / "paging.py"]:
        assert len(path.read_text().splitlines()) <= 500, path.name


def test_replay_loads_no_heavy_package():
    code = ("import sys, localinfer.serve.replay, localinfer.commands.replay; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
