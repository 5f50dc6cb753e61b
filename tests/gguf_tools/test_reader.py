"""The bounded reader agrees with gguf.GGUFReader and rejects broken files with GGUFFormatError."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from gguf_tools import GGUFFormatError, read_header


def _reference(path):
    r = GGUFReader(str(path))
    kv = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        kv[name] = f.contents()
    tensors = {t.name: t for t in r.tensors}
    return r, kv, tensors


def _agree(path):
    h = read_header(path)
    r, kv, tensors = _reference(path)
    assert h.kv.keys() == kv.keys()
    for key, value in kv.items():
        mine = h.kv[key]
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            np.testing.assert_allclose(mine, value, rtol=0, atol=0)
        else:
            assert mine == value, key
        ftype = r.fields[key].types
        assert h.kv_types[key][0] == ftype[0]
        if ftype[0] == GGUFValueType.ARRAY:
            assert h.kv_types[key][1] == ftype[-1]
    assert [t.name for t in h.tensors] == list(tensors)
    for t in h.tensors:
        ref = tensors[t.name]
        assert t.shape == tuple(int(x) for x in ref.shape)
        assert t.type == ref.tensor_type
        assert t.n_elements == int(ref.n_elements)
        assert t.n_bytes == int(ref.n_bytes)
        assert t.file_offset == int(ref.data_offset)
    assert h.alignment == r.alignment
    return h


def test_agrees_with_gguf_reader_on_tiny(tiny_gguf):
    h = _agree(tiny_gguf)
    assert h.architecture == "llama"
    assert h.data_offset % h.alignment == 0
    assert h.bytes_read < 256 * 1024


def test_agrees_with_gguf_reader_on_default_model(default_model):
    h = _agree(default_model)
    assert h.architecture == "llama"
    assert len(h.kv["tokenizer.ggml.tokens"]) == 49152
    assert h.data_offset + h.data_size == h.file_size
    # header only: bounded reads, nowhere near the ~100 MB of weights
    assert h.bytes_read < 4 * 1024 * 1024


def test_quantized_types_agree(tmp_path):
    from gguf import GGMLQuantizationType as T

    from tests.support.ggufgen import write_tiny_llama

    for qt in (T.Q8_0, T.Q4_0, T.F16):
        _agree(write_tiny_llama(tmp_path / f"{qt.name}.gguf", qtype=qt))


def test_truncated_download_is_named(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFFormatError) as exc:
        read_header(cut)
    assert "truncated" in str(exc.value)
    assert exc.value.facts["needed"] == len(data)
    assert exc.value.facts["available"] == len(data) - 1000


def test_every_header_prefix_fails_cleanly(tiny_gguf, tmp_path):
    h = read_header(tiny_gguf)
    data = tiny_gguf.read_bytes()
    p = tmp_path / "prefix.gguf"
    for n in list(range(0, 64)) + list(range(64, h.header_size, 97)):
        p.write_bytes(data[:n])
        with pytest.raises(GGUFFormatError):
            read_header(p)


def test_huge_array_count_rejected_before_allocation(tmp_path):
    # one kv: key "a", type ARRAY of UINT8 with 2**30 items and no payload
    body = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1)
    body += struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.UINT8, 2**30)
    p = tmp_path / "huge.gguf"
    p.write_bytes(body)
    with pytest.raises(GGUFFormatError) as exc:
        read_header(p)
    assert exc.value.field.endswith(".count")


@pytest.mark.parametrize(
    "blob,word",
    [
        (b"", "empty"),
        (b"PK\x03\x04" + b"\0" * 60, "zip"),
        (struct.pack("<Q", 100) + b'{"__metadata__":{}}' + b"\0" * 80, "safetensors"),
        (b"FUGG" + b"\0" * 60, "big-endian"),
        (b"GGUF" + struct.pack(">I", 3) + b"\0" * 60, "byte-swapped"),
        (b"GGUF" + struct.pack("<I", 1) + b"\0" * 60, "v1"),
    ],
)
def test_wrong_magic_and_version(tmp_path, blob, word):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(GGUFFormatError) as exc:
        read_header(p)
    assert word.lower() in str(exc.value).lower()


def test_not_a_regular_file(tmp_path):
    with pytest.raises(GGUFFormatError, match="directory"):
        read_header(tmp_path)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFFormatError, match="regular"):
        read_header(fifo)
    loop = tmp_path / "loop.gguf"
    os.symlink(loop, loop)
    with pytest.raises(GGUFFormatError):
        read_header(loop)
    with pytest.raises(GGUFFormatError, match="no such file"):
        read_header(tmp_path / "missing.gguf")
