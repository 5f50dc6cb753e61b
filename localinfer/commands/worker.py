"""`localinfer worker`: serve this machine's devices to llama.cpp clients over its RPC protocol.

The worker is llama.cpp's own RPC server (``ggml_backend_rpc_start_server``
from the installed library, no separate binary), run in a child process so
that SIGTERM and Ctrl-C end it cleanly: it serves every accelerator here, or
the CPU when there is none.  It binds loopback unless ``--allow-remote``: the
protocol has no authentication and no encryption, and its server has had
memory-safety advisories, so expose it only on a trusted private link.
Clients: ``localinfer run|chat|serve|bench --rpc HOST:PORT``, ``localinfer fit --rpc HOST:PORT``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

DEFAULT_PORT = 50052
READY_TIMEOUT = 30.0
WARNING = ("warning: the llama.cpp RPC protocol has no authentication or encryption, and its server has had "
           "memory-safety advisories: anyone who can reach {ep} can allocate this machine's memory, read and "
           "write what it holds and run computations on it. Use it only on a trusted private network "
           "(a direct cable, a VPN, a LAN where every host is yours).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                        help="address to bind (default 127.0.0.1; any other needs --allow-remote)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                        help=f"TCP port (default {DEFAULT_PORT}; 0: pick a free one and print it)")
    parser.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                        help="CPU threads for the CPU device (default: the usable cores)")
    parser.add_argument("--mem", default=None, metavar="SIZE",
                        help="memory to offer per device, e.g. 16GiB, and the most its buffers may hold: a "
                             "client's allocation past it is refused (default: what the device reports; a CPU "
                             "reports all of its RAM)")
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help="keep uploaded weights in DIR, keyed by hash, so a reload skips the network")
    parser.add_argument("--allow-remote", action="store_true",
                        help="bind a non-loopback address (read the security warning it prints)")


def _check(args) -> str:
    from localinfer.backends.llamacpp.rpc_probe import is_loopback, parse_endpoint
    from localinfer.errors import UsageError
    from localinfer.generation.load import usable_cores

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} is out of range", flag="--port", hint="use 1..65535, or 0 for any")
    if args.threads is not None and not 0 < args.threads <= 1024:
        raise UsageError(f"--threads {args.threads} is out of range", flag="--threads", hint="use 1..1024")
    if not is_loopback(args.host) and not args.allow_remote:
        raise UsageError(f"--host {args.host} is not a loopback address; the RPC protocol has no authentication",
                         flag="--host", hint="add --allow-remote on a trusted private network only, "
                                             "or keep the default 127.0.0.1")
    if args.cache is not None:
        try:
            os.makedirs(args.cache, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--cache {args.cache}: {exc.strerror}", flag="--cache") from None
    args.threads = min(args.threads or usable_cores(), usable_cores())
    if args.mem is not None:
        from localinfer.units import parse_size

        try:
            args.mem = parse_size(args.mem)
        except ValueError as exc:
            raise UsageError(f"--mem: {exc}", flag="--mem", hint="e.g. --mem 16GiB") from None
        if args.mem <= 0:
            raise UsageError("--mem must be positive", flag="--mem", hint="e.g. --mem 16GiB")
    if ":" in args.host or "[" in args.host:
        raise UsageError(f"--host {args.host}: llama.cpp's RPC server listens on an IPv4 address or a host name",
                         flag="--host", hint="use 127.0.0.1 (or localhost)")
    return parse_endpoint(f"{args.host}:{args.port or 1}").rpartition(":")[0]


def reserve_port(host: str, port: int) -> int:
    """Check that ``host:port`` can be bound (port 0: find a free one); UsageError when it is in use."""
    from localinfer.errors import UsageError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: {exc.strerror}", flag="--host") from None
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as llama.cpp's server does
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == 98 or "in use" in str(exc).lower():
                raise UsageError(f"port {port} on {host} is already in use (another worker?)", flag="--port",
                                 hint="pick another --port, or --port 0 for any free one") from None
            raise UsageError(f"cannot bind {host}:{port}: {exc.strerror}", flag="--host") from None
        return s.getsockname()[1]


def _wait_ready(child: subprocess.Popen, ep: str) -> None:
    from localinfer.backends.llamacpp.rpc_probe import listening
    from localinfer.errors import WorkerError

    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise WorkerError(f"the worker for {ep} exited with status {child.returncode} before serving",
                              endpoint=ep, hint="its messages are above")
        if listening(ep, timeout=0.5):
            return
        time.sleep(0.1)
    raise WorkerError(f"the worker for {ep} did not start listening within {READY_TIMEOUT:g} s", endpoint=ep)


def run(args: argparse.Namespace) -> int:
    from localinfer.backends.llamacpp import rpc, rpc_probe
    from localinfer.util.signals import Terminated

    host = _check(args)
    rpc.library()   # refuse an incompatible llama.cpp here, in one line, not in the child
    port = reserve_port(host, args.port)
    ep = f"{host}:{port}"
    if not rpc_probe.is_loopback(host):
        print(WARNING.format(ep=ep), file=sys.stderr)
    cmd = [sys.executable, "-m", "localinfer.backends.llamacpp.rpc", ep, str(args.threads),
           os.path.abspath(args.cache) if args.cache else "-"]
    if args.mem:
        cmd.append(str(args.mem))
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_ready(child, ep)
        print(f"worker listening on {ep} ({args.threads} threads); clients: --rpc {ep}", file=sys.stderr, flush=True)
        return_code = child.wait()
        return 0 if return_code == 0 else 1
    except (KeyboardInterrupt, Terminated):
        print("\nworker stopping", file=sys.stderr)
        return 0
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
