"""Ask a llama.cpp RPC worker what it serves, over its own wire protocol, with a timeout (no llama_cpp import).

A request is ``| command (1 byte) | size (u64) | payload |``, an answer
``| size (u64) | payload |``, little-endian (ggml-rpc.cpp).  A session opens
with HELLO (command 14, 24 bytes of transport capabilities; answer: major,
minor, patch, padding, 24 bytes); then DEVICE_COUNT (15, empty; u32) and
GET_DEVICE_MEMORY (11, u32 device; u64 free, u64 total) and GET_ALIGNMENT (1, u32 device; u64).  A worker serves one
client at a time, so a worker in use accepts the connection and stays silent:
that is reported as busy.  ``fit --rpc`` uses this; ``run --rpc`` probes each
endpoint first because llama.cpp aborts the process when it cannot connect.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from localinfer.errors import UsageError, WorkerError

PROTO_MAJOR = 7          # RPC_PROTO_MAJOR_VERSION of the llama.cpp llama-cpp-python 0.3.36 vendors
CMD_GET_ALIGNMENT, CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 1, 11, 14, 15
CAPS = 24                # RPC_CONN_CAPS_SIZE
MAX_DEVICES = 16


@dataclass(frozen=True)
class WorkerDevice:
    endpoint: str
    index: int           # device number on that worker
    free: int
    total: int
    alignment: int = 32  # its buffer alignment: 128 on CUDA, 32 on CPU and Metal

    @property
    def kind(self) -> str:
        """Allocation rules to plan with: "cuda" when the worker aligns as ggml-cuda does, else "cpu"."""
        return "cuda" if self.alignment >= 128 else "cpu"


@dataclass(frozen=True)
class WorkerInfo:
    endpoint: str
    version: tuple[int, int, int]
    devices: tuple[WorkerDevice, ...]


def parse_endpoint(text: str) -> str:
    """``host:port`` checked (UsageError naming --rpc); IPv6 hosts in brackets are refused as llama.cpp does."""
    t = text.strip()
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "[" in host or ":" in host:
        raise UsageError(f"--rpc: {text!r} is not host:port", flag="--rpc", hint="e.g. --rpc 192.168.1.20:50052")
    return f"{host}:{int(port)}"


def parse_endpoints(value) -> list[str]:
    """A comma-separated string or a list of endpoints, each checked, duplicates refused."""
    items = value.split(",") if isinstance(value, str) else list(value)
    eps = [parse_endpoint(x) for x in items if str(x).strip()]
    if not eps:
        raise UsageError("--rpc needs at least one host:port", flag="--rpc")
    dup = {e for e in eps if eps.count(e) > 1}
    if dup:
        raise UsageError(f"--rpc lists {', '.join(sorted(dup))} twice", flag="--rpc")
    return eps


def _split(ep: str) -> tuple[str, int]:
    host, _, port = ep.rpartition(":")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening(ep: str, timeout: float = 1.0) -> bool:
    """Whether anything accepts TCP connections at ``ep`` (a busy worker does)."""
    try:
        with socket.create_connection(_split(ep), timeout=timeout):
            return True
    except OSError:
        return False


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("closed")
        out += part
    return out


def _call(sock: socket.socket, cmd: int, payload: bytes, answer: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv(sock, 8))
    if size != answer:
        raise ConnectionError(f"answered {size} bytes to command {cmd}, expected {answer}")
    return _recv(sock, size)


def probe(ep: str, timeout: float = 5.0) -> WorkerInfo:
    """HELLO, device count and each device's memory; WorkerError naming ``ep`` when it cannot answer."""
    ep = parse_endpoint(ep)
    try:
        sock = socket.create_connection(_split(ep), timeout=timeout)
    except TimeoutError:
        raise WorkerError(f"RPC worker {ep} did not accept a connection within {timeout:g} s", endpoint=ep,
                          hint="check the address and that no firewall drops the port") from None
    except OSError as exc:
        raise WorkerError(f"RPC worker {ep} is unreachable: {exc.strerror or exc}", endpoint=ep,
                          hint=f"start one there: localinfer worker --port {_split(ep)[1]}") from None
    try:
        with sock:
            sock.settimeout(timeout)
            major, minor, patch = struct.unpack("<BBB", _call(sock, CMD_HELLO, bytes(CAPS), 4 + CAPS)[:3])
            if major != PROTO_MAJOR:
                raise WorkerError(f"RPC worker {ep} speaks protocol v{major}.{minor}.{patch}; this llama.cpp "
                                  f"speaks v{PROTO_MAJOR}", endpoint=ep,
                                  hint="run the same localinfer/llama-cpp-python version on every host")
            (n,) = struct.unpack("<I", _call(sock, CMD_DEVICE_COUNT, b"", 4))
            devs = []
            for i in range(min(n, MAX_DEVICES)):
                free, total = struct.unpack("<QQ", _call(sock, CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                (align,) = struct.unpack("<Q", _call(sock, CMD_GET_ALIGNMENT, struct.pack("<I", i), 8))
                devs.append(WorkerDevice(ep, i, free, total, align))
    except TimeoutError:
        raise WorkerError(f"RPC worker {ep} accepted but did not answer within {timeout:g} s (it serves one "
                          "client at a time: is another localinfer or llama.cpp using it?)", endpoint=ep,
                          hint="stop the other client, or start a second worker on another port") from None
    except (ConnectionError, OSError) as exc:
        raise WorkerError(f"RPC worker {ep} closed the connection ({exc}); is it a llama.cpp RPC worker?",
                          endpoint=ep, hint="check the port; the worker's log says why it refused") from None
    if not devs:
        raise WorkerError(f"RPC worker {ep} offers no devices", endpoint=ep)
    return WorkerInfo(ep, (major, minor, patch), tuple(devs))
