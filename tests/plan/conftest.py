"""Fixtures the host-split tests share: a GPU too small to hold tests/support/tiny_moe.py's model, whose host is
the DDR5 desktop profile; a Qwen3-30B-A3B Q8_0 skeleton (header only); the CLI's --json answer."""

import json

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.cli import main
from localinfer.devices.profiles import profile_from_dict


@pytest.fixture(scope="module")
def gpu():
    return profile_from_dict({"name": "tiny-gpu", "kind": "cuda", "memory": "500MiB", "bandwidth": "1000GB/s",
                              "bf16_flops": 100e12, "link": {"per_direction": "32GB/s"}, "host": "ddr5-5600-2ch"})


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    """Qwen3-30B-A3B Q8_0 (32 GB of weights), a skeleton: planned from its header, nothing to read."""
    return str(write_skeleton("qwen3-30b-a3b", tmp_path_factory.mktemp("qwen3_30b") / "q.gguf", type="q8_0"))


@pytest.fixture
def cli_json(capsys):
    """``localinfer ARGV --json``: asserts exit 0 and returns the parsed answer."""
    def run(*argv) -> dict:
        assert main([*argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    return run
