"""Bad input (RELIABILITY.md §A): every malformed file is a GGUFFormatError, a one-line CLI error,
a non-zero exit, no traceback, bounded memory — built from tiny valid files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as V
from gguf import GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_tools import GGUFFormatError, read_header
from gguf_tools.inspect import account
from gguf_tools.split import read_model_header
from localinfer.model.spec import ModelSpec
from tests.support.ggufgen import write_tiny_llama

_SCALAR = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
           V.FLOAT32: "f", V.BOOL: "B", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _value(vtype: V, value, sub: V | None = None) -> bytes:
    if vtype == V.STRING:
        return _s(value)
    if vtype == V.ARRAY:
        return struct.pack("<IQ", sub, len(value)) + b"".join(_value(sub, v) for v in value)
    return struct.pack("<" + _SCALAR[vtype], value)


@dataclass
class Raw:
    """A GGUF file as editable parts; ``bytes()`` encodes it exactly as GGUFWriter does."""

    kv: list[tuple[bytes, int, bytes]]                     # (key, value type, encoded value)
    tensors: list[list]                                    # [name bytes, dims, type id, offset]
    data: bytes
    alignment: int = 32
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int | None = None
    n_kv: int | None = None
    tail: bytes = field(default=b"")

    @classmethod
    def of(cls, path: Path) -> "Raw":
        h = read_header(path)
        kv = [(k.encode(), int(h.kv_types[k][0]), _value(h.kv_types[k][0], v, h.kv_types[k][1]))
              for k, v in h.kv.items()]
        tensors = [[t.name.encode(), list(t.shape), int(t.type), t.offset] for t in h.tensors]
        data = path.read_bytes()[h.data_offset:]
        return cls(kv, tensors, data, h.alignment)

    def set_kv(self, key: str, vtype: int, payload: bytes) -> "Raw":
        self.kv = [e for e in self.kv if e[0] != key.encode()] + [(key.encode(), vtype, payload)]
        return self

    def bytes(self) -> bytes:
        out = bytearray(self.magic + struct.pack("<I", self.version))
        out += struct.pack("<QQ", len(self.tensors) if self.n_tensors is None else self.n_tensors,
                           len(self.kv) if self.n_kv is None else self.n_kv)
        for key, vtype, payload in self.kv:
            out += _s(key) + struct.pack("<I", vtype) + payload
        for name, dims, ttype, offset in self.tensors:
            out += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            out += struct.pack("<IQ", ttype, offset)
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out + self.data + self.tail)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hostile") / "base.gguf", n_vocab=64, n_layers=1)


def test_encoder_round_trips_a_valid_file(base):
    assert Raw.of(base).bytes() == base.read_bytes()


def _kv_index(raw: Raw, key: str) -> int:
    return next(i for i, e in enumerate(raw.kv) if e[0] == key.encode())


def _edit_tensor(i: int, slot: int, value):
    def f(r: Raw):
        r.tensors[i][slot] = value
    return f


def _set(attr, value):
    return lambda r: setattr(r, attr, value)


U64_MAX = (1 << 64) - 1
# (id, mutation of Raw, substring expected in the error's field)
FORMAT_CASES = [
    ("magic-safetensors", lambda r: setattr(r, "magic", b"\x08\x00\x00\x00"), "magic"),
    ("magic-reversed", _set("magic", b"FUGG"), "magic"),
    ("version-1", _set("version", 1), "version"),
    ("version-4", _set("version", 4), "version"),
    ("version-byteswapped", _set("version", 3 << 24), "version"),
    ("n_tensors-max", _set("n_tensors", U64_MAX), "n_tensors"),
    ("n_kv-max", _set("n_kv", U64_MAX), "n_kv"),
    ("n_kv-plus-one", lambda r: setattr(r, "n_kv", len(r.kv) + 1), ""),
    ("n_tensors-plus-one", lambda r: setattr(r, "n_tensors", len(r.tensors) + 1), ""),
    ("string-length-max", lambda r: r.set_kv("x.s", V.STRING, struct.pack("<Q", U64_MAX)), "x.s"),
    ("string-length-past-end", lambda r: r.set_kv("x.s", V.STRING, struct.pack("<Q", 1 << 40) + b"abc"), "x.s"),
    ("array-2^30-no-payload", lambda r: r.set_kv("x.a", V.ARRAY, struct.pack("<IQ", V.UINT32, 1 << 30)), "x.a"),
    ("array-count-max", lambda r: r.set_kv("x.a", V.ARRAY, struct.pack("<IQ", V.UINT8, U64_MAX)), "x.a"),
    ("string-array-count-max", lambda r: r.set_kv("x.a", V.ARRAY, struct.pack("<IQ", V.STRING, U64_MAX)), "x.a"),
    ("nested-array", lambda r: r.set_kv("x.a", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1)), "x.a"),
    ("array-unknown-item-type", lambda r: r.set_kv("x.a", V.ARRAY, struct.pack("<IQ", 99, 1) + b"\0" * 8), "x.a"),
    ("unknown-value-type", lambda r: r.set_kv("x.u", 99, b"\0" * 8), "x.u"),
    ("bool-2", lambda r: r.set_kv("x.b", V.BOOL, b"\x02"), "x.b"),
    ("bool-array-2", lambda r: r.set_kv("x.b", V.ARRAY, struct.pack("<IQ", V.BOOL, 2) + b"\x01\x02"), "x.b"),
    ("empty-key", lambda r: r.kv.insert(0, (b"", V.UINT32, b"\0" * 4)), "key"),
    ("duplicate-key", lambda r: r.kv.append(r.kv[0]), "key"),
    ("key-not-utf8", lambda r: r.kv.insert(1, (b"bad\xff\xfe", V.UINT32, b"\0" * 4)), "key"),
    ("key-length-huge", lambda r: r.kv.insert(1, (b"k" * 70000, V.UINT32, b"\0" * 4)), "key"),
    ("alignment-0", lambda r: r.set_kv("general.alignment", V.UINT32, struct.pack("<I", 0)), "alignment"),
    ("alignment-3", lambda r: r.set_kv("general.alignment", V.UINT32, struct.pack("<I", 3)), "alignment"),
    ("alignment-u64", lambda r: r.set_kv("general.alignment", V.UINT64, struct.pack("<Q", 32)), "alignment"),
    ("alignment-string", lambda r: r.set_kv("general.alignment", V.STRING, _s("32")), "alignment"),
    ("alignment-absurd", lambda r: r.set_kv("general.alignment", V.UINT32, struct.pack("<I", 1 << 31)), "alignment"),
    ("tensor-name-empty", _edit_tensor(0, 0, b""), "name"),
    ("tensor-name-64-bytes", _edit_tensor(0, 0, b"t" * 64), "name"),
    ("tensor-name-not-utf8", _edit_tensor(0, 0, b"\xff\xfe"), "name"),
    ("tensor-name-duplicate", lambda r: r.tensors[1].__setitem__(0, r.tensors[0][0]), "name"),
    ("n_dims-0", _edit_tensor(0, 1, []), "n_dims"),
    ("n_dims-5", _edit_tensor(0, 1, [64, 1, 1, 1, 1]), "n_dims"),
    ("dim-zero", _edit_tensor(0, 1, [64, 0]), "ne"),
    ("dim-negative", _edit_tensor(0, 1, [64, (1 << 64) - 5]), "ne"),
    ("dims-overflow", _edit_tensor(0, 1, [1 << 32, 1 << 32]), "ne"),
    ("type-removed-q4_2", _edit_tensor(0, 2, 4), "type"),
    ("type-unknown", _edit_tensor(0, 2, 999), "type"),
    ("row-not-multiple-of-block", lambda r: r.tensors[1].__setitem__(2, 10), "ne[0]"),  # 64-value norm as Q2_K
    ("offset-unaligned", lambda r: r.tensors[1].__setitem__(3, r.tensors[1][3] + 4), "offset"),
    ("offset-overlap", lambda r: r.tensors[1].__setitem__(3, 0), "offset"),
    ("offsets-out-of-order", lambda r: r.tensors.reverse(), "offset"),
    ("offset-past-end", lambda r: r.tensors[-1].__setitem__(3, 1 << 40), "data"),
    ("offset-overflow", lambda r: r.tensors[-1].__setitem__(3, U64_MAX - 31), "offset"),
    ("data-truncated", lambda r: setattr(r, "data", r.data[: len(r.data) // 2]), "data"),
    ("data-missing", lambda r: setattr(r, "data", b""), "data"),
]


@pytest.mark.parametrize("case, mutate, fld", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_malformed_header(tmp_path, base, case, mutate, fld):
    raw = Raw.of(base)
    mutate(raw)
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(raw.bytes())
    with pytest.raises(GGUFFormatError) as info:
        read_header(path)
    err = info.value
    assert fld in err.field
    assert "\n" not in str(err) and len(str(err)) < 400


def test_truncation_message_has_byte_counts(tmp_path, base):
    raw = Raw.of(base)
    raw.data = raw.data[:1000]
    path = tmp_path / "short.gguf"
    path.write_bytes(raw.bytes())
    err = pytest.raises(GGUFFormatError, read_header, path).value
    assert "truncated" in str(err) and err.facts["needed"] > err.facts["available"] == path.stat().st_size
    assert f"{err.facts['needed'] - err.facts['available']:,} missing" in str(err)


def test_every_prefix_of_the_header_is_rejected(tmp_path, base):
    end = read_header(base).data_offset
    path = tmp_path / "prefix.gguf"
    path.write_bytes(base.read_bytes()[:end])
    for n in range(end, -1, -1):
        os.truncate(path, n)
        with pytest.raises(GGUFFormatError):
            read_header(path)


@pytest.mark.parametrize("head, says", [
    (b"", "empty"),
    (b"GG", "too short"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\":{}}", "safetensors"),
    (b"PK\x03\x04" + b"\0" * 40, "zip"),
    (b"\x80\x02}q\x00" + b"\0" * 40, "pickle"),
    (b"<!DOCTYPE html><html>", "HTML"),
    (b'{"error": "not found"}', "JSON"),
    (b"tjgg" + b"\0" * 40, "GGML"),
])
def test_wrong_magic_says_what_the_file_is(tmp_path, head, says):
    path = tmp_path / "x.gguf"
    path.write_bytes(head)
    err = pytest.raises(GGUFFormatError, read_header, path).value
    assert says.lower() in str(err).lower()


# --- model metadata that lies: caught by ModelSpec.from_gguf ------------------------------------

def _tiny(tmp_path, name="m.gguf", **kw) -> Path:
    return write_tiny_llama(tmp_path / name, n_vocab=64, n_layers=2, **kw)


U32, I32, STR, F32 = V.UINT32, V.INT32, V.STRING, V.FLOAT32
METADATA_CASES = [
    ("no-architecture", {"general.architecture": ("", STR)}, "general.architecture"),
    ("block_count-0", {"llama.block_count": (0, U32)}, "block_count"),
    ("block_count-too-small", {"llama.block_count": (1, U32)}, "block_count"),
    ("block_count-too-large", {"llama.block_count": (7, U32)}, "block_count"),
    ("head_count-0", {"llama.attention.head_count": (0, U32)}, "head_count"),
    ("head_count_kv-0", {"llama.attention.head_count_kv": (0, U32)}, "head_count_kv"),
    ("heads-not-divisible", {"llama.attention.head_count_kv": (3, U32)}, "head_count"),
    ("heads-vs-shapes", {"llama.attention.head_count_kv": (4, U32)}, "head_count"),
    ("head_count-negative", {"llama.attention.head_count": (-4, I32)}, "head_count"),
    ("embedding_length-vs-shapes", {"llama.embedding_length": (128, U32)}, "embedding_length"),
    ("context-0", {"llama.context_length": (0, U32)}, "context_length"),
    ("context-absurd", {"llama.context_length": (1 << 31, U32)}, "context_length"),
    ("context-string", {"llama.context_length": ("8k", STR)}, "context_length"),
    ("vocab_size-vs-embedding", {"llama.vocab_size": (999, U32)}, "vocab"),
    ("tokens-wrong-type", {"tokenizer.ggml.tokens": ([1, 2, 3], V.ARRAY)}, "tokenizer.ggml.tokens"),
    ("tokens-wrong-length", {"tokenizer.ggml.tokens": (["a", "b"], V.ARRAY)}, "tokenizer.ggml.tokens"),
    ("scores-wrong-length", {"tokenizer.ggml.scores": ([0.5] * 3, V.ARRAY)}, "tokenizer.ggml.scores"),
    ("token_type-wrong-length", {"tokenizer.ggml.token_type": ([1] * 7, V.ARRAY)}, "tokenizer.ggml.token_type"),
    ("expert_used-gt-count", {"llama.expert_count": (4, U32), "llama.expert_used_count": (8, U32)},
     "expert_used_count"),
    ("adapter-file", {"general.type": ("adapter", STR)}, "general.type"),
]


def _lie(raw: Raw, kv: dict) -> Raw:
    for key, (value, vtype) in kv.items():
        if vtype == V.ARRAY:
            sub = V.STRING if isinstance(value[0], str) else V.FLOAT32 if isinstance(value[0], float) else V.INT32
            raw.set_kv(key, V.ARRAY, _value(V.ARRAY, value, sub))
        elif key == "general.architecture":
            raw.kv.pop(_kv_index(raw, key))
        else:
            raw.set_kv(key, vtype, _value(vtype, value))
    return raw


@pytest.mark.parametrize("case, kv, fld", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_metadata_that_lies(tmp_path, case, kv, fld):
    raw = _lie(Raw.of(_tiny(tmp_path)), kv)
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(raw.bytes())
    header = read_header(path)                          # the container itself is well-formed
    with pytest.raises(GGUFFormatError) as info:
        ModelSpec.from_gguf(header)
    assert fld in info.value.field
    assert "\n" not in str(info.value)


# --- files that change under you ---------------------------------------------------------------

def test_directory_fifo_symlink_loop(tmp_path):
    os.mkfifo(tmp_path / "fifo.gguf")
    (tmp_path / "loop.gguf").symlink_to(tmp_path / "loop.gguf")
    (tmp_path / "dir.gguf").mkdir()
    for name, says in (("fifo.gguf", "not a regular file"), ("loop.gguf", "cannot stat"),
                       ("dir.gguf", "directory"), ("absent.gguf", "no such file")):
        err = pytest.raises(GGUFFormatError, read_header, tmp_path / name).value
        assert says in str(err) and err.hint


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable(tmp_path, base):
    path = tmp_path / "locked.gguf"
    path.write_bytes(base.read_bytes())
    path.chmod(0)
    err = pytest.raises(GGUFFormatError, read_header, path).value
    assert "permission" in str(err).lower()


def _write_split(tmp_path: Path, n_shards: int = 3) -> list[Path]:
    w = GGUFWriter(str(tmp_path / "split.gguf"), "llama", split_max_tensors=2)
    w.add_block_count(1)
    rng = np.random.default_rng(0)
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight",
                 "output_norm.weight", "output.weight")[: 2 * n_shards - 1]:
        w.add_tensor(name, rng.standard_normal((4, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(tmp_path.glob("split-*-of-*.gguf"))


def test_split_model_reads_whole_and_names_a_missing_shard(tmp_path):
    shards = _write_split(tmp_path)
    assert [p.name for p in shards] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    merged = read_model_header(shards[1])                  # any shard finds the others
    assert len(merged.tensors) == 5 and merged.file_size == sum(p.stat().st_size for p in shards)
    acc = account([read_header(p) for p in shards])
    assert acc.file_size == merged.file_size
    shards[2].unlink()
    err = pytest.raises(GGUFFormatError, read_model_header, shards[0]).value
    assert "split-00003-of-00003.gguf is missing" in str(err)
    shards[1].rename(shards[1].with_name("renamed.gguf"))
    err = pytest.raises(GGUFFormatError, read_model_header, shards[1].with_name("renamed.gguf")).value
    assert "cannot be found" in str(err)


# --- through the CLI: one line, non-zero exit, no traceback, bounded memory ---------------------

_CLI_RUNNER = r"""
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from localinfer.cli import main
results = []
for path in sys.argv[1:]:
    err = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["inspect", path])
    results.append({"path": path, "rc": rc, "stderr": err.getvalue(), "s": time.perf_counter() - t})
# VmHWM is this process's own peak: ru_maxrss would also count the pytest process it was forked from
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"results": results, "maxrss_kib": hwm}))
"""


def _bad_files(tmp_path, base) -> list[Path]:
    paths = []
    for case, mutate, _ in FORMAT_CASES:
        raw = Raw.of(base)
        mutate(raw)
        p = tmp_path / f"f-{case}.gguf"
        p.write_bytes(raw.bytes())
        paths.append(p)
    good = _tiny(tmp_path, "good.gguf")
    for case, kv, _ in METADATA_CASES:
        p = tmp_path / f"m-{case}.gguf"
        p.write_bytes(_lie(Raw.of(good), kv).bytes())
        paths.append(p)
    os.mkfifo(tmp_path / "fifo.gguf")
    (tmp_path / "loop.gguf").symlink_to(tmp_path / "loop.gguf")
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "empty.gguf").write_bytes(b"")
    paths += [tmp_path / n for n in ("fifo.gguf", "loop.gguf", "dir.gguf", "empty.gguf", "absent.gguf")]
    split = tmp_path / "split"
    split.mkdir()
    shards = _write_split(split)
    shards[1].unlink()
    paths.append(shards[0])
    return paths


def test_cli_reports_every_bad_file_in_one_line(tmp_path, base):
    paths = _bad_files(tmp_path, base)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "LOCALINFER_DEBUG": ""}
    proc = subprocess.run([sys.executable, "-c", _CLI_RUNNER, *map(str, paths)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for r in report["results"]:
        lines = r["stderr"].splitlines()
        if r["path"].endswith(("m-no-architecture.gguf", "m-adapter-file.gguf")):
            assert r["rc"] == 0 and not lines, r            # valid GGUFs that are not models: shown (issue 17)
            continue
        assert r["rc"] not in (0, 70), r                     # 70 = internal error
        assert lines and lines[0].startswith("error: ") and "Traceback" not in r["stderr"], r
        assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint: ")), r
    assert report["maxrss_kib"] < 512 * 1024


def test_control_characters_from_the_file_are_escaped(tmp_path, base):
    raw = Raw.of(base)
    raw.kv.append((b"evil\n\x1b[2J\rkey", 0x7FFF, b""))          # a key that clears the screen, bad type
    path = tmp_path / "evil.gguf"
    path.write_bytes(raw.bytes())
    with pytest.raises(GGUFFormatError) as e:
        read_header(path)
    text = str(e.value)
    assert "\n" not in text and "\x1b" not in text and "\r" not in text
    assert "evil\\n\\x1b[2J\\rkey" in text and "unknown value type" in text
    proc = subprocess.run(["localinfer", "inspect", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1 and "\x1b" not in proc.stderr


def test_cli_entry_point_exit_code(tmp_path, base):
    raw = Raw.of(base)
    raw.n_kv = U64_MAX
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw.bytes())
    proc = subprocess.run(["localinfer", "inspect", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr and "n_kv" in proc.stderr
    debug = subprocess.run(["localinfer", "--debug", "inspect", str(path)], capture_output=True, text=True,
                           timeout=60)
    assert "Traceback" in debug.stderr and "GGUFFormatError" in debug.stderr


# --- random mutations: only a valid parse or GGUFFormatError ------------------------------------

@pytest.fixture(scope="module")
def seed_file(tmp_path_factory) -> tuple[bytes, int]:
    path = write_tiny_llama(tmp_path_factory.mktemp("mut") / "seed.gguf", n_vocab=32, n_layers=1, n_embd=32,
                            n_ff=64, extra_kv={"general.alignment": (64, V.UINT32)})
    return path.read_bytes(), read_header(path).data_offset


_edit = st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 1 << 16),
                  st.integers(0, 255), st.integers(1, 8))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_edit, min_size=1, max_size=4))
def test_random_header_mutations(tmp_path, seed_file, edits):
    blob, header_end = seed_file
    data = bytearray(blob)
    for op, pos, byte, n in edits:
        at = pos % header_end
        if op == "flip":
            data[at] ^= 1 << (byte % 8)
        elif op == "set":
            data[at:at + n] = bytes([byte]) * n
        elif op == "insert":
            data[at:at] = bytes([byte]) * n
        else:
            del data[at:at + n]
    path = tmp_path / "mut.gguf"
    path.write_bytes(bytes(data))
    try:
        h = read_header(path)
    except GGUFFormatError as exc:
        assert "\n" not in str(exc)
        return
    acc = account(h)
    assert acc.tensor_bytes + acc.header_and_padding == acc.file_size == len(data)
    try:
        ModelSpec.from_gguf(h)
    except GGUFFormatError:
        pass
