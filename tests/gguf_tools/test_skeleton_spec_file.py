"""skeleton --spec FILE reads a bounded amount from a regular file only."""

from __future__ import annotations

import os

import pytest

from gguf_tools.skeleton import MAX_SPEC_BYTES, load_spec_file


def test_a_device_a_fifo_or_a_huge_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo.toml")
    for path in ("/dev/zero", tmp_path / "fifo.toml"):     # was: read_bytes() forever / blocked
        with pytest.raises(ValueError, match="not a regular file"):
            load_spec_file(path)
    big = tmp_path / "big.toml"
    big.write_text("#" * (MAX_SPEC_BYTES + 10))
    with pytest.raises(ValueError, match="KiB"):
        load_spec_file(big)


def test_absurd_sizes_are_refused_before_planning_tensors(tmp_path):
    # was: n_layers = 100000000 planned 1.2 billion tensor entries in memory
    from gguf_tools.skeleton import normalize_spec

    spec = {"arch": "llama", "n_layers": 100_000_000, "n_embd": 4096, "n_head": 32, "n_ff": 14336,
            "vocab_size": 128256}
    with pytest.raises(ValueError, match="n_layers.*more than any model"):
        normalize_spec(spec)
    assert normalize_spec({**spec, "n_layers": 32})["n_layers"] == 32
