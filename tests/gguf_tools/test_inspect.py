"""`inspect`: the byte accounting of SPEC §8.4 in exact bytes, escaping, and the command."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

from gguf_tools import read_header
from gguf_tools.inspect import account, active_parameters, describe_value, safe_text
from gguf_tools.presets import PRESETS
from gguf_tools.skeleton import write_skeleton
from localinfer.cli import main
from localinfer.units import GiB
from tests.support.ggufgen import write_tiny_llama


def _identities(path):
    h = read_header(path)
    acc = account(h)
    assert acc.codes + acc.floats + acc.meta + acc.header + acc.padding + acc.trailing == h.file_size
    assert acc.codes_and_floats + acc.meta + acc.header_and_padding == acc.file_size == h.file_size
    assert acc.tensor_bytes == sum(t.n_bytes for t in h.tensors)
    assert acc.header == h.header_size
    assert sum(t.n_bytes for t in acc.by_type) == acc.tensor_bytes
    assert sum(t.code_bytes for t in acc.by_type) == acc.codes + acc.floats
    assert sum(t.meta_bytes for t in acc.by_type) == acc.meta
    assert sum(t.n_elements for t in acc.by_type) == acc.n_params == sum(t.n_elements for t in h.tensors)
    assert sum(t.n_tensors for t in acc.by_type) == len(h.tensors)
    for tb in acc.by_type:
        assert tb.code_bytes + tb.meta_bytes == tb.n_bytes
        assert tb.meta_bytes == 0 or tb.quantized
    return h, acc


def test_section_8_4_split_of_qwen3_235b_q2_k(tmp_path):
    h, acc = _identities(write_skeleton("qwen3-235b-a22b", tmp_path / "q.gguf"))
    assert acc.codes_and_floats == 69_178_275_840
    assert acc.meta == 16_506_720_256
    assert round(acc.codes_and_floats / GiB, 2) == 64.43
    assert round(acc.meta / GiB, 2) == 15.37
    # the real file adds its 6,006,016-byte header (tokenizer included) to the same tensor bytes
    assert acc.tensor_bytes + 6_006_016 == 85_691_002_112
    assert round((acc.tensor_bytes + 6_006_016) / GiB, 2) == 79.81
    q2k = next(t for t in acc.by_type if t.type == "Q2_K")
    assert q2k.bits_per_weight == 2.625 and q2k.meta_bytes * 84 == q2k.n_bytes * 20
    assert abs(active_parameters(h) / 1e9 - 22) < 0.5          # "A22B"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_identities_on_every_preset(tmp_path, preset):
    _identities(write_skeleton(preset, tmp_path / "m.gguf"))


def test_identities_on_the_embedded_model(default_model):
    h, acc = _identities(default_model)
    assert acc.header == h.data_offset and acc.padding == 0 and acc.trailing == 0
    assert {t.type for t in acc.by_type} == {"Q4_1", "Q8_0", "F32"}
    assert next(t for t in acc.by_type if t.type == "Q8_0").bits_per_weight == 8.5
    assert next(t for t in acc.by_type if t.type == "Q4_1").bits_per_weight == 5.0


def test_padding_and_trailing_bytes_are_counted(tmp_path):
    # 97-token vocabulary and 96-wide rows: tensor sizes that are not multiples of 32 leave gaps
    path = write_tiny_llama(tmp_path / "odd.gguf", n_embd=96, n_head=3, n_head_kv=1, n_ff=160, n_vocab=97,
                            qtype=T.Q8_0)
    with open(path, "ab") as fh:
        fh.write(b"\0" * 1000)
    h, acc = _identities(path)
    assert acc.trailing >= 1000
    assert acc.padding > h.data_offset - h.header_size               # gaps between tensors too


def test_quantized_and_float_bits_per_weight(tmp_path):
    h, acc = _identities(write_tiny_llama(tmp_path / "q4.gguf", qtype=T.Q4_0))
    q4 = next(t for t in acc.by_type if t.type == "Q4_0")
    assert q4.bits_per_weight == 4.5 and q4.code_bytes * 18 == q4.n_bytes * 16
    assert next(t for t in acc.by_type if t.type == "F32").bits_per_weight == 32
    assert acc.bits_per_weight() == h.file_size * 8 / acc.n_params


def test_safe_text_escapes_control_and_ansi():
    s = safe_text("red\x1b[31mX\x1b[0m\nnext\u202eevil\x07")
    assert "\x1b" not in s and "\n" not in s and "\u202e" not in s and "\x07" not in s
    assert "\\x1b[31m" in s and "\\u202e" in s and "\\x07" in s
    long = safe_text("A" * 100_000, 50)
    assert len(long) < 80 and "100,000 chars" in long
    assert describe_value(["a"] * 152_000).startswith("[152,000 items: a, a, a, a, …]")


def _hostile_metadata_file(tmp_path):
    evil = {
        "general.name": "\x1b[2J\x1b[31mpwned\nsecond line",
        "general.description": "B" * 200_000,
        "evil.\x1b[1mkey": "v",
    }
    return write_tiny_llama(tmp_path / "evil.gguf", extra_kv=evil)


def test_cli_text_escapes_metadata(tmp_path, capsys):
    path = _hostile_metadata_file(tmp_path)
    assert main(["inspect", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "pwned\\nsecond line" in out
    assert max(len(line) for line in out.splitlines()) < 400
    assert "blk.1.ffn_down.weight" in out


def test_cli_json_matches_accounting(tmp_path, capsys):
    path = write_skeleton("qwen3-8b", tmp_path / "q.gguf", type="q2_k")
    assert main(["inspect", str(path), "--json", "--tensors"]) == 0
    data = json.loads(capsys.readouterr().out)
    acc = account(read_header(path))
    assert data["accounting"]["codes_and_floats"] == acc.codes_and_floats
    assert data["accounting"]["meta"] == acc.meta
    assert data["accounting"]["header_and_padding"] == acc.header_and_padding
    assert data["file_size"] == acc.file_size
    assert len(data["tensors"]) == data["n_tensors"] == 399
    assert data["model"]["n_head_kv"] == 8 and data["model"]["arch"] == "qwen3"
    assert data["bytes_read"] < 1 << 20                              # the header only


def test_cli_json_long_values_are_cut(tmp_path, capsys):
    path = _hostile_metadata_file(tmp_path)
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["metadata"]["general.description"]) < 5000
    assert data["metadata"]["tokenizer.ggml.tokens"]["count"] == 256


def test_cli_default_model_text(capsys, default_model):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    acc = account(read_header(default_model))
    assert f"{acc.codes_and_floats:,}" in out and f"{acc.meta:,}" in out and f"{acc.header_and_padding:,}" in out
    assert "llama" in out and f"{acc.n_params:,}" in out


def test_typed_metadata_value_kinds(tmp_path, capsys):
    extra = {"x.f": (float("inf"), GGUFValueType.FLOAT32), "x.b": (True, GGUFValueType.BOOL)}
    path = write_tiny_llama(tmp_path / "k.gguf", extra_kv=extra)
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metadata"]["x.f"] == "inf" and data["metadata"]["x.b"] is True
