"""The layers, checked by folder: imports point one way, and planning never loads a backend runtime.

Static rules read every ``import`` statement (module level or inside a function)
of every source file, so a module added later is checked too.  A dynamic check
imports the planning modules in a fresh interpreter, runs the planning commands,
and asserts that torch, llama_cpp and mlx were never loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "llama_cpp", "mlx", "mlx_lm", "triton")
RUNTIMES = ("localinfer.backends.llamacpp.engine", "localinfer.backends.llamacpp.native",
            "localinfer.backends.llamacpp.dryrun_child", "localinfer.backends.vocab",
            "localinfer.backends.mlx.engine", "localinfer.backends.mlx.kv", "localinfer.backends.mlx.model",
            "localinfer.backends.mlx.weights", "localinfer.backends.mlx.reference", "cuda_backend")
MEMORY_MODULES = ("localinfer/backends/memory.py", "localinfer/backends/llamacpp/memory.py",
                  "localinfer/backends/llamacpp/placement.py", "localinfer/backends/llamacpp/compute_buffer.py",
                  "localinfer/backends/mlx/memory.py", "cuda_backend/memory.py", "localinfer/backends/split.py",
                  "localinfer/backends/llamacpp/split.py", "localinfer/backends/llamacpp/split_compute.py",
                  "localinfer/backends/llamacpp/rpc_probe.py", "cuda_backend/support.py",
                  "localinfer/backends/mlx/support.py")
# a memory model may ask another memory-level module (what an engine runs, without its runtime)
MEMORY_LEVEL = tuple(m.removesuffix(".py").replace("/", ".") for m in MEMORY_MODULES)
ABOVE_BACKENDS = ("localinfer.plan", "localinfer.generation", "localinfer.serve", "localinfer.report",
                  "localinfer.commands", "localinfer.cli")
MAX_LINES = 500
MAX_TOP_LEVEL = 8

# folder -> imports (module prefixes) its files may never make
RULES: dict[str, tuple[str, ...]] = {
    "gguf_tools": ("localinfer", "cuda_backend", *HEAVY),
    "localinfer/util": ("localinfer.model", "localinfer.devices", "localinfer.backends", *ABOVE_BACKENDS, *HEAVY),
    "localinfer/model": ("localinfer.devices", "localinfer.backends", *ABOVE_BACKENDS, *HEAVY, "cuda_backend"),
    "localinfer/devices": ("localinfer.backends", *ABOVE_BACKENDS, "cuda_backend"),
    "localinfer/plan": ("localinfer.generation", "localinfer.serve", "localinfer.report", "localinfer.commands",
                        "localinfer.cli", *RUNTIMES, *HEAVY),
    "localinfer/backends": ABOVE_BACKENDS,
    "cuda_backend": ABOVE_BACKENDS,
    "localinfer/generation": ("localinfer.serve", "localinfer.report", "localinfer.commands", "localinfer.cli",
                            *RUNTIMES, *HEAVY),
    # the step engine and the server see the backends' contracts and registry only: no backend by name
    "localinfer/serve": ("localinfer.report", "localinfer.commands", "localinfer.cli", "localinfer.loadgen",
                         "localinfer.backends.llamacpp", "localinfer.backends.mlx", "cuda_backend", *HEAVY),
    "localinfer/loadgen": ("localinfer.commands", "localinfer.cli"),
    "localinfer/report": ("localinfer.generation", "localinfer.serve", "localinfer.commands", "localinfer.cli",
                          *RUNTIMES, *HEAVY),
}


def sources(folder: str = "") -> list[Path]:
    roots = [ROOT / folder] if folder else [ROOT / "localinfer", ROOT / "gguf_tools", ROOT / "cuda_backend"]
    return sorted(p for r in roots for p in r.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) of every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module
            out.append((node.lineno, mod, id(node) in top))
    return out


def _hits(module: str, banned: tuple[str, ...]) -> bool:
    return any(module == b or module.startswith(b + ".") for b in banned)


def violations() -> list[str]:
    found = []
    for folder, banned in RULES.items():
        for path in sources(folder):
            for line, mod, _ in imports(path):
                if _hits(mod, banned):
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    for rel in MEMORY_MODULES:
        for line, mod, _ in imports(ROOT / rel):
            if _hits(mod, (*HEAVY, *RUNTIMES)) and mod not in MEMORY_LEVEL:
                found.append(f"{rel}:{line} (a memory model) imports {mod}")
    for path in sources("localinfer/serve"):
        for line, mod, top in imports(path):
            if top and _hits(mod, (*HEAVY, *RUNTIMES)):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {mod} at module level")
    return found


def test_imports_point_one_way():
    assert violations() == []


def test_the_rules_catch_a_planning_module_that_imports_the_runner(tmp_path):
    bad = ROOT / "localinfer" / "plan" / "_hygiene_probe.py"
    bad.write_text("from localinfer.generation.runner import Runner\nimport torch\n")
    try:
        found = violations()
    finally:
        bad.unlink()
    assert any("_hygiene_probe.py:1 imports localinfer.generation.runner" in v for v in found)
    assert any("_hygiene_probe.py:2 imports torch" in v for v in found)


def test_files_fit_on_a_few_screens_and_the_top_level_stays_small():
    long = {str(p.relative_to(ROOT)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    top = sorted(p.name for p in (ROOT / "localinfer").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_the_planner_names_no_backend():
    for path in sources("localinfer/plan"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("llama.cpp", "torch", "mlx")
                    for c in [node.left, *node.comparators]):
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} compares a backend name")


# ---- dynamic: planning really loads no backend --------------------------------------

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
PLANNING_FOLDERS = ("gguf_tools", "localinfer/util", "localinfer/model", "localinfer/devices", "localinfer/plan",
                    "localinfer/report")
PLANNING_COMMANDS = ("inspect", "skeleton", "fit", "devices", "plan", "report")


def planning_modules() -> list[str]:
    mods = ["localinfer", "localinfer.units", "localinfer.errors", "localinfer.backends.registry"]
    mods += [module_name(p) for f in PLANNING_FOLDERS for p in sources(f)]
    mods += [module_name(ROOT / rel) for rel in MEMORY_MODULES]
    mods += [f"localinfer.commands.{c}" for c in PLANNING_COMMANDS]
    return mods


def _probe(modules: list[str], commands: list[list[str]]) -> dict:
    code = (_PROBE.replace("FORBIDDEN", repr(HEAVY)).replace("MODULES", repr(modules))
            .replace("COMMANDS", repr(commands)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_discovery_finds_the_core_modules():
    mods = planning_modules()
    for name in ("gguf_tools.reader", "localinfer.model.spec", "localinfer.plan.fit", "localinfer.plan.paging",
                 "localinfer.backends.llamacpp.memory", "cuda_backend.memory", "localinfer.report.capacity"):
        assert name in mods
    assert not any(m.startswith(RUNTIMES) and m not in MEMORY_LEVEL for m in mods)


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory) -> Path:
    from gguf_tools.skeleton import write_skeleton

    return write_skeleton("qwen3-8b", tmp_path_factory.mktemp("hyg") / "q.gguf", type="q4_0")


def test_planning_modules_and_commands_import_no_backend(skeleton):
    commands = [["inspect", str(skeleton)], ["inspect"], ["skeleton", "--list"], ["devices"],
                ["fit", str(skeleton)], ["fit", str(skeleton), "--backend", "torch"],
                ["fit", str(skeleton), "--backend", "mlx"], ["plan", str(skeleton)], ["report", str(skeleton)]]
    out = _probe(planning_modules(), commands)
    assert out["commands"]["inspect"] == 0 and out["commands"]["fit"] == 0
    if out["after_imports"] or out["after_commands"]:
        culprits = {m: leaked[:3] for m in planning_modules() if (leaked := _probe([m], [])["after_imports"])}
        pytest.fail(f"backend modules imported: at import {out['after_imports'][:5]}, by commands "
                    f"{out['after_commands'][:5]}; importers: {culprits}")
    assert not out["errors"], out["errors"]
