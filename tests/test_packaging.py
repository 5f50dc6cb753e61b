"""The distribution ships every package in the tree, and the profiles with it."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _configured_packages() -> tuple[set[str], dict[str, str]]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(conf["packages"]), conf.get("package-dir", {})


def test_every_package_directory_is_listed():
    listed, mapped = _configured_packages()
    found = set()
    for top in ("localinfer", "gguf_tools", "cuda_backend"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found.add(".".join(rel.parts))
    for package, folder in mapped.items():
        assert (ROOT / folder / "__init__.py").exists(), package
        found.add(package)
    assert found == listed, f"pyproject lists {sorted(listed)}, tree has {sorted(found)}"


def test_profiles_are_importable_resources():
    names = {p.name for p in resources.files("localinfer.profiles").iterdir()}
    assert "README.md" in names
    assert sum(n.endswith(".toml") for n in names) >= 7
