"""Bounded, defensive GGUF header reader.

Reads only the header (metadata key/values and tensor infos), never the tensor
data, with reads bounded by what the file can hold.  Every count is checked
against the bytes left in the file *before* anything proportional to it is
looped over or allocated, so a hostile file costs at most its own size.

File layout (GGUF v2/v3, little-endian)::

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv × ( string key | u32 value_type | value )
    n_tensors × ( string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset )
    padding to general.alignment (default 32)
    tensor data; each tensor at data_start + offset (offsets aligned)

    string = u64 length | length bytes (UTF-8)
    array  = u32 item_type | u64 count | count items
"""

from __future__ import annotations

import os
import stat
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ._constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from .errors import GGUFFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
MAX_KEY_BYTES = 65535
MAX_TENSOR_NAME_BYTES = 63  # ggml's GGML_MAX_NAME is 64 including the NUL
MAX_DIMS = 4
INT64_MAX = (1 << 63) - 1
_CHUNK = 64 * 1024
_U64 = struct.Struct("<Q")

# Fixed-size scalar value types: struct code and size.
_SCALARS: dict[GGUFValueType, tuple[str, int]] = {
    GGUFValueType.UINT8: ("B", 1),
    GGUFValueType.INT8: ("b", 1),
    GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2),
    GGUFValueType.UINT32: ("I", 4),
    GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4),
    GGUFValueType.BOOL: ("B", 1),
    GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8),
    GGUFValueType.FLOAT64: ("d", 8),
}
# array typecodes of the numeric array item types (GGUF is little-endian).
_ARRAY_CODES = {t: code for t, (code, _) in _SCALARS.items()}
_SWAP = sys.byteorder != "little"
# Smallest possible encodings, used to bound counts before looping.
_MIN_STRING = 8
_MIN_KV = _MIN_STRING + 1 + 4 + 1          # key "x", type, 1-byte value
_MIN_TENSOR_INFO = _MIN_STRING + 1 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry.  ``shape`` is in GGUF order (ne[0], the row length, first)."""

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    offset: int          # relative to the start of the data section, as stored
    file_offset: int     # absolute byte offset in the file
    n_elements: int
    n_bytes: int

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.type][0]


@dataclass
class GGUFHeader:
    """Everything in a GGUF file except the tensor data."""

    path: str
    file_size: int
    version: int
    alignment: int
    header_size: int               # bytes up to the end of the tensor infos
    data_offset: int               # absolute start of the data section (aligned)
    kv: dict[str, Any]
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[TensorInfo]
    bytes_read: int = 0            # how many bytes the reader pulled from the file
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.kv.get(key, default)

    @property
    def architecture(self) -> str | None:
        arch = self.kv.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> TensorInfo | None:
        if not self._by_name:
            self._by_name = {t.name: t for t in self.tensors}
        return self._by_name.get(name)

    @property
    def data_size(self) -> int:
        """Bytes of the data section as declared (last tensor end, padding inside included)."""
        if not self.tensors:
            return 0
        return max(t.offset + t.n_bytes for t in self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


class _Cursor:
    """Sequential reader over a file with bounds checks and a read counter."""

    def __init__(self, fh: BinaryIO, size: int, path: str):
        self.fh = fh
        self.size = size
        self.path = path
        self.buf = b""
        self.buf_start = 0      # file offset of buf[0]
        self.pos = 0            # absolute file offset of the next unread byte
        self.bytes_read = 0

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def fail(self, message: str, fld: str, offset: int | None = None, **facts) -> GGUFFormatError:
        return GGUFFormatError(
            message, field=fld, offset=self.pos if offset is None else offset, path=self.path, **facts
        )

    def _ensure(self, n: int, fld: str) -> int:
        """Make n bytes at pos available in buf; return their index in buf."""
        if n > self.remaining:
            raise self.fail(
                f"file ends inside the header: {fld} needs {n} bytes at offset {self.pos}, "
                f"only {self.remaining} left (file size {self.size}); the file is truncated",
                fld, needed=n, available=self.remaining,
            )
        idx = self.pos - self.buf_start
        if idx + n > len(self.buf):
            want = max(n, _CHUNK)
            want = min(want, self.size - self.pos)
            self.fh.seek(self.pos)
            data = self.fh.read(want)
            self.bytes_read += len(data)
            if len(data) < n:
                raise self.fail(
                    f"short read at offset {self.pos}: wanted {n} bytes, got {len(data)} "
                    "(file changed or unreadable while reading)", fld,
                )
            self.buf, self.buf_start, idx = data, self.pos, 0
        return idx

    def take(self, n: int, fld: str) -> memoryview:
        idx = self._ensure(n, fld)
        self.pos += n
        return memoryview(self.buf)[idx:idx + n]

    def scalar(self, code: str, size: int, fld: str):
        idx = self._ensure(size, fld)
        self.pos += size
        return struct.unpack_from("<" + code, self.buf, idx)[0]

    def u32(self, fld: str) -> int:
        return self.scalar("I", 4, fld)

    def u64(self, fld: str) -> int:
        return self.scalar("Q", 8, fld)

    def string_bytes(self, fld: str, limit: int | None = None) -> bytes:
        start = self.pos
        n = self.u64(fld + ".length")
        if n > self.remaining:
            raise self.fail(
                f"{fld} claims a string of {n} bytes but only {self.remaining} bytes remain in the file",
                fld + ".length", offset=start, needed=n, available=self.remaining,
            )
        if limit is not None and n > limit:
            raise self.fail(f"{fld} is {n} bytes long; the limit is {limit}", fld, offset=start, limit=limit)
        return bytes(self.take(n, fld))

    def strings(self, count: int, fld: str) -> list[str]:
        """count GGUF strings in a row (u64 length + bytes each), decoded with replacement.

        The hot loop of a tokenizer array (150K+ strings): works on the buffer
        directly and refills it in chunks, with the same bounds checks as string_bytes.
        """
        out: list[str] = []
        append = out.append
        unpack = _U64.unpack_from
        buf, idx = self.buf, self.pos - self.buf_start
        end = len(buf)
        for i in range(count):
            if idx + 8 > end:
                self.pos = self.buf_start + idx
                idx, buf = self._ensure(8, f"{fld}[{i}].length"), self.buf
                end = len(buf)
            n = unpack(buf, idx)[0]
            idx += 8
            if idx + n > end:
                self.pos = self.buf_start + idx
                left = self.remaining
                if n > left:
                    raise self.fail(
                        f"{fld}[{i}] claims a string of {n} bytes but only {left} bytes remain in the file",
                        f"{fld}[{i}].length", needed=n, available=left,
                    )
                idx, buf = self._ensure(n, f"{fld}[{i}]"), self.buf
                end = len(buf)
            append(buf[idx:idx + n].decode("utf-8", "replace"))
            idx += n
        self.pos = self.buf_start + idx
        return out


def _decode(raw: bytes, cur: _Cursor, fld: str, offset: int, strict: bool) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        if strict:
            raise cur.fail(f"{fld} is not valid UTF-8", fld, offset=offset) from None
        return raw.decode("utf-8", errors="replace")


def _value_type(raw: int, cur: _Cursor, fld: str, offset: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{fld} has unknown value type {raw}", fld, offset=offset) from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, fld: str) -> tuple[Any, GGUFValueType | None]:
    """Read one value of vtype; returns (value, array item type or None)."""
    if vtype == GGUFValueType.STRING:
        start = cur.pos
        return _decode(cur.string_bytes(fld), cur, fld, start, strict=False), None
    if vtype == GGUFValueType.ARRAY:
        start = cur.pos
        item_type = _value_type(cur.u32(fld + ".item_type"), cur, fld + ".item_type", start)
        count_at = cur.pos
        count = cur.u64(fld + ".count")
        if item_type == GGUFValueType.ARRAY:
            raise cur.fail(f"{fld} is an array of arrays; nested arrays are not supported", fld, offset=start)
        if item_type == GGUFValueType.STRING:
            if count > cur.remaining // _MIN_STRING:
                raise cur.fail(
                    f"{fld} claims {count} strings but only {cur.remaining} bytes remain "
                    f"(at least {_MIN_STRING} per string)", fld + ".count", offset=count_at,
                    needed=count * _MIN_STRING, available=cur.remaining,
                )
            return cur.strings(count, fld), item_type
        code, size = _SCALARS[item_type]
        if count > cur.remaining // size:
            raise cur.fail(
                f"{fld} claims {count} items of {size} bytes but only {cur.remaining} bytes remain",
                fld + ".count", offset=count_at, needed=count * size, available=cur.remaining,
            )
        raw = cur.take(count * size, fld)
        arr = array(_ARRAY_CODES[item_type])
        arr.frombytes(raw)
        if _SWAP:
            arr.byteswap()
        if item_type == GGUFValueType.BOOL:
            if count and max(arr) > 1:
                raise cur.fail(f"{fld} holds a bool that is neither 0 nor 1", fld, offset=start)
            return [bool(x) for x in arr.tolist()], item_type
        return arr.tolist(), item_type
    code, size = _SCALARS[vtype]
    at = cur.pos
    value = cur.scalar(code, size, fld)
    if vtype == GGUFValueType.BOOL:
        if value > 1:
            raise cur.fail(f"{fld} is a bool with byte value {value}; must be 0 or 1", fld, offset=at)
        value = bool(value)
    return value, None


def _sniff(magic: bytes, head: bytes) -> str:
    """Say what a non-GGUF file looks like."""
    if magic[::-1] == GGUF_MAGIC:
        return "a big-endian GGUF? magic bytes are reversed"
    if magic in (b"tjgg", b"lmgg", b"fmgg") or magic[::-1] in (b"tjgg", b"lmgg", b"fmgg"):
        return "a legacy GGML/GGJT file; convert it to GGUF with llama.cpp's convert scripts"
    if magic[:2] == b"PK":
        return "a zip archive (a PyTorch .pt/.bin checkpoint?); convert it to GGUF with llama.cpp's convert_hf_to_gguf.py"
    if magic[:1] == b"\x80" and magic[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle (a PyTorch checkpoint?); convert it to GGUF first"
    if len(head) >= 9 and head[8:9] == b"{":
        return "a safetensors file; convert it to GGUF with llama.cpp's convert_hf_to_gguf.py"
    if head[:1] in (b"{", b"["):
        return "a JSON file, not model weights"
    if head[:5].lower() in (b"<!doc", b"<html"):
        return "an HTML page (a failed download?)"
    return f"unknown magic {magic!r}"


def _open_checked(path: str | os.PathLike) -> tuple[BinaryIO, int, str]:
    spath = os.fspath(path)
    try:
        st = os.stat(spath)
    except FileNotFoundError:
        raise GGUFFormatError(
            "no such file", field="file", path=spath, hint="check the path to the .gguf file"
        ) from None
    except OSError as exc:
        raise GGUFFormatError(
            f"cannot stat file: {exc.strerror or exc}", field="file", path=spath,
            hint="check the path (symlink loop? permissions?)",
        ) from None
    if stat.S_ISDIR(st.st_mode):
        raise GGUFFormatError("is a directory, not a GGUF file", field="file", path=spath,
                              hint="pass the .gguf file inside it")
    if not stat.S_ISREG(st.st_mode):
        raise GGUFFormatError("is not a regular file (FIFO, socket or device)", field="file", path=spath,
                              hint="pass a regular .gguf file")
    try:
        fh = open(spath, "rb")
    except OSError as exc:
        raise GGUFFormatError(f"cannot open file: {exc.strerror or exc}", field="file", path=spath,
                              hint="check the file's permissions") from None
    return fh, st.st_size, spath


def read_header(path: str | os.PathLike, *, check_data: bool = True) -> GGUFHeader:
    """Parse a GGUF file's header with bounded reads.

    Raises ``GGUFFormatError`` for anything malformed.  With ``check_data`` (the
    default) the file must also be long enough to hold every tensor the header
    declares; a short file is reported as a truncated download with byte counts.
    """
    fh, size, spath = _open_checked(path)
    with fh:
        return _parse(_Cursor(fh, size, spath), check_data)


def _parse(cur: _Cursor, check_data: bool) -> GGUFHeader:
    if cur.size == 0:
        raise cur.fail("the file is empty (0 bytes); the download probably failed", "magic", offset=0)
    if cur.size < 4:
        raise cur.fail(f"the file is only {cur.size} bytes; too short to be a GGUF", "magic", offset=0)
    cur._ensure(min(cur.size, 16), "magic")
    head = cur.buf[:16]
    magic = bytes(cur.take(4, "magic"))
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(
            f"not a GGUF file: {_sniff(magic, head)}", field="magic", offset=0, path=cur.path,
            hint="pass a .gguf model file",
        )
    version = cur.u32("version")
    if version not in (2, 3):
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        why = ("byte-swapped (big-endian) GGUF files are not supported" if swapped in (1, 2, 3)
               else "GGUF v1 is obsolete" if version == 1 else "this reader supports versions 2 and 3")
        raise cur.fail(f"unsupported GGUF version {version}: {why}", "version", offset=4,
                       hint="re-convert the model with a current llama.cpp")
    n_tensors = cur.u64("n_tensors")
    n_kv = cur.u64("n_kv")
    if n_kv > cur.remaining // _MIN_KV or n_tensors > cur.remaining // _MIN_TENSOR_INFO or (
        n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > cur.remaining
    ):
        raise cur.fail(
            f"header claims {n_tensors} tensors and {n_kv} metadata entries, which cannot fit in the "
            f"{cur.remaining} bytes left in the file", "n_tensors" if n_tensors > n_kv else "n_kv",
            offset=8, needed=n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO, available=cur.remaining,
        )

    kv: dict[str, Any] = {}
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for i in range(n_kv):
        at = cur.pos
        fld = f"kv[{i}].key"
        key = _decode(cur.string_bytes(fld, limit=MAX_KEY_BYTES), cur, fld, at, strict=True)
        if not key:
            raise cur.fail(f"metadata entry {i} has an empty key", fld, offset=at)
        if key in kv:
            raise cur.fail(f"metadata key {key!r} appears twice", fld, offset=at)
        t_at = cur.pos
        vtype = _value_type(cur.u32(f"{key}.type"), cur, f"{key}.type", t_at)
        value, item_type = _read_value(cur, vtype, key)
        kv[key] = value
        kv_types[key] = (vtype, item_type)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        a = kv["general.alignment"]
        if kv_types["general.alignment"][0] != GGUFValueType.UINT32:
            raise cur.fail("general.alignment must be a uint32", "general.alignment")
        if a <= 0 or a & (a - 1) or a > MAX_ALIGNMENT:
            raise cur.fail(
                f"general.alignment is {a}; it must be a power of two between 1 and {MAX_ALIGNMENT}",
                "general.alignment", limit=MAX_ALIGNMENT,
            )
        alignment = a

    raw_tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        fld = f"tensor[{i}]"
        name = _decode(cur.string_bytes(fld + ".name"), cur, fld + ".name", at, strict=True)
        if not name:
            raise cur.fail(f"tensor {i} has an empty name", fld + ".name", offset=at)
        if len(name.encode()) > MAX_TENSOR_NAME_BYTES:
            raise cur.fail(
                f"tensor {i} name is {len(name.encode())} bytes; ggml allows {MAX_TENSOR_NAME_BYTES}",
                fld + ".name", offset=at, limit=MAX_TENSOR_NAME_BYTES,
            )
        if name in names:
            raise cur.fail(f"tensor name {name!r} appears twice", fld + ".name", offset=at)
        names.add(name)
        fld = f"tensor[{i}:{name}]"
        d_at = cur.pos
        n_dims = cur.u32(fld + ".n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"{name} has {n_dims} dimensions; must be 1..{MAX_DIMS}", fld + ".n_dims", offset=d_at)
        shape = tuple(cur.u64(f"{fld}.ne[{j}]") for j in range(n_dims))
        n_elements = 1
        for j, d in enumerate(shape):
            if d == 0 or d > INT64_MAX:
                raise cur.fail(f"{name} has dimension ne[{j}] = {d}", f"{fld}.ne[{j}]", offset=d_at)
            n_elements *= d
        if n_elements > INT64_MAX:
            raise cur.fail(f"{name} has {n_elements} elements, which overflows int64", fld + ".ne", offset=d_at)
        t_at = cur.pos
        type_id = cur.u32(fld + ".type")
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise cur.fail(
                f"{name} has unknown or removed tensor type id {type_id}", fld + ".type", offset=t_at,
                hint="the file needs a newer (or older) llama.cpp, or is corrupt",
            ) from None
        if shape[0] % block:
            raise cur.fail(
                f"{name} row length {shape[0]} is not a multiple of {qtype.name}'s block size {block}",
                fld + ".ne[0]", offset=d_at,
            )
        n_bytes = n_elements // block * type_size
        o_at = cur.pos
        offset = cur.u64(fld + ".offset")
        if offset % alignment:
            raise cur.fail(f"{name} data offset {offset} is not aligned to {alignment}", fld + ".offset", offset=o_at)
        raw_tensors.append((name, shape, qtype, offset, n_elements, n_bytes, o_at))

    header_size = cur.pos
    data_offset = -(-header_size // alignment) * alignment
    tensors: list[TensorInfo] = []
    prev_end = 0
    prev_name = None
    for name, shape, qtype, offset, n_elements, n_bytes, o_at in raw_tensors:
        if offset < prev_end:
            raise cur.fail(
                f"{name} data at offset {offset} overlaps or precedes {prev_name} (which ends at {prev_end}); "
                "tensor offsets must be in order and non-overlapping", f"tensor:{name}.offset", offset=o_at,
            )
        end = offset + n_bytes
        if data_offset + end > INT64_MAX:
            raise cur.fail(f"{name} ends beyond any possible file size", f"tensor:{name}.offset", offset=o_at)
        tensors.append(TensorInfo(name, shape, qtype, offset, data_offset + offset, n_elements, n_bytes))
        prev_end, prev_name = end, name

    header = GGUFHeader(
        path=cur.path, file_size=cur.size, version=version, alignment=alignment,
        header_size=header_size, data_offset=data_offset, kv=kv, kv_types=kv_types, tensors=tensors,
        bytes_read=cur.bytes_read,
    )
    if check_data and tensors:
        need = data_offset + header.data_size
        if cur.size < need:
            raise GGUFFormatError(
                f"the file is truncated: the header declares tensor data up to byte {need:,} but the file has "
                f"{cur.size:,} bytes ({need - cur.size:,} missing); the download is incomplete",
                field="data", offset=cur.size, path=cur.path, needed=need, available=cur.size,
                hint="download the file again (check its size or checksum)",
            )
    return header
