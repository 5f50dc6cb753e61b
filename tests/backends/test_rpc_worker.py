"""`localinfer worker` and the RPC client's failure modes on loopback: a worker killed mid-generation, a wrong
port, a busy worker, a busy port, a non-loopback bind, SIGTERM; every process and port cleaned up."""

import ctypes
import ctypes.util
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import psutil
import pytest

from tests.support.rpc_workers import ROOT, workers

pytest.importorskip("llama_cpp")

from localinfer.backends.llamacpp import rpc, rpc_probe
from localinfer.commands.worker import reserve_port
from localinfer.errors import BackendUnavailableError, WorkerError

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "localinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT, check=False)


def _free_port() -> int:
    return reserve_port("127.0.0.1", 0)


def test_probe_reads_devices_and_memory():
    with workers(1) as [(_, ep)]:
        info = rpc_probe.probe(ep)
    assert info.version[0] == rpc_probe.PROTO_MAJOR
    assert len(info.devices) == 1 and info.devices[0].total > 0 and info.devices[0].kind == "cpu"


def test_worker_killed_mid_generation_is_an_error_naming_it():
    with workers(2) as ws:
        (_, ep1), (victim, ep2) = ws
        proc = subprocess.Popen([sys.executable, "-m", "localinfer", "run", "-p", "Tell me a long story", "--raw",
                                 "-n", "3000", "--ignore-eos", "-t", "1", "-c", "4096", "--rpc", f"{ep1},{ep2}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 90)
            assert ready and proc.stdout.read(1), "no output before the kill"
            victim.kill()
            victim.wait()
            rc = proc.wait(timeout=60)            # nothing hangs
            err = proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert rc == WorkerError.exit_code, err
        assert f"error: RPC worker {ep2} went away" in err
        assert ep1 not in err.splitlines()[-2]    # the live worker is not blamed
        assert rpc_probe.probe(ep1).devices       # and serves the next client


def test_wrong_port_is_a_typed_error():
    port = _free_port()
    for cmd in (["run", "-p", "hi", "-n", "2", "--rpc", f"127.0.0.1:{port}"], ["fit", "--rpc", f"127.0.0.1:{port}"]):
        r = _cli(*cmd)
        assert r.returncode == WorkerError.exit_code, r.stderr
        assert f"error: RPC worker 127.0.0.1:{port} is unreachable" in r.stderr
        assert "Traceback" not in r.stderr


def test_bad_endpoint_and_split_flags():
    for flags, word in ((["--rpc", "nohost"], "--rpc"), (["--rpc", "a:1,a:1"], "twice"),
                        (["--devices", "m2-max-96gb", "--tensor-split", "x"], "--tensor-split"),
                        (["--tensor-split", "1,1"], "--rpc or --devices"), (["--devices", "no-such-gpu"], "no-such")):
        r = _cli("fit", *flags)
        assert r.returncode == 2 and word in r.stderr, (flags, r.stderr)


def test_busy_worker_is_reported_not_waited_on():
    with workers(1) as [(_, ep)]:
        host, port = ep.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as held:   # another client holds the worker
            held.sendall(struct.pack("<BQ", rpc_probe.CMD_HELLO, rpc_probe.CAPS) + bytes(rpc_probe.CAPS))
            held.recv(8 + 4 + rpc_probe.CAPS)
            t0 = time.monotonic()
            with pytest.raises(WorkerError, match="one client at a time"):
                rpc_probe.probe(ep, timeout=1.0)
            assert time.monotonic() - t0 < 5


def test_non_loopback_bind_is_refused():
    r = _cli("worker", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    assert "not a loopback address" in r.stderr and "--allow-remote" in r.stderr


def test_busy_port_is_one_line():
    with workers(1) as [(_, ep)]:
        r = _cli("worker", "--port", ep.rsplit(":", 1)[1], timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("error: port ") and "already in use" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2          # error + hint


def test_sigterm_stops_worker_and_its_child():
    proc = subprocess.Popen([sys.executable, "-m", "localinfer", "worker", "--port", "0", "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, cwd=ROOT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "listening on" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
        ep = line.split("listening on ")[1].split()[0]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children and rpc_probe.listening(ep)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "worker stopping" in proc.stderr.read()
        psutil.wait_procs(children, timeout=10)
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        assert not rpc_probe.listening(ep)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_incompatible_library_is_refused_in_one_line():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    with pytest.raises(BackendUnavailableError, match="does not export ggml_backend_reg_by_name"):
        rpc.check_exports({"ggml": libc, "ggml-base": libc, "ggml-rpc": libc})
    with pytest.raises(BackendUnavailableError, match="no libggml-rpc.so"):
        lib = rpc.library()
        rpc.check_exports({"ggml": lib.ggml, "ggml-base": lib.base})
    assert rpc.library().rpc is not None      # the installed one passes


def test_no_worker_processes_left():
    mine = psutil.Process().children(recursive=True)
    assert not [p for p in mine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "llamacpp.rpc" in " ".join(p.cmdline())]


def test_serve_exits_naming_a_worker_that_dies_mid_request():
    import http.client
    import json
    import urllib.request

    port = _free_port()
    with workers(1) as [(victim, ep)]:
        server = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", "--rpc", ep, "--port", str(port),
                                   "-t", "1", "-c", "1024", "--parallel", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, cwd=ROOT, text=True)
        try:
            line, deadline = "", time.monotonic() + 90
            while not line.startswith("ready") and time.monotonic() < deadline and server.poll() is None:
                line = server.stderr.readline()
            assert line.startswith("ready"), line
            body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Once upon a time",
                               "max_tokens": 900, "stream": True, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
            frames = []
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.readline()                # tokens are streaming
                victim.kill()
                victim.wait()
                try:
                    while line := resp.readline():    # the stream ends with the error, then the server goes down
                        frames.append(line.decode().strip())
                except (ConnectionError, OSError, http.client.IncompleteRead):
                    pass
            rc = server.wait(timeout=30)
            err = server.stderr.read()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    assert rc == WorkerError.exit_code
    assert f"error: RPC worker {ep} went away" in err
    data = [f.removeprefix("data: ") for f in frames if f.startswith("data: ")]
    assert data[-1] == "[DONE]", frames[-5:]
    error = json.loads(data[-2])["error"]
    assert f"RPC worker {ep} went away" in error["message"] and error["code"] == "engine_error", error


def _alloc(sock, size: int) -> int:
    ptr, _ = struct.unpack("<QQ", rpc_probe._call(sock, 0, struct.pack("<IQ", 0, size), 16))   # RPC_CMD_ALLOC_BUFFER
    return ptr


def test_worker_holds_to_its_mem():
    """`worker --mem`: buffers past it are refused (the client is told, as when a device is full) and come back when
    freed; the device's free memory says what is left; a message claiming more than the worker may hold is dropped
    with its client, not read into memory; the worker goes on serving."""
    mib = 1 << 20
    with workers(1, mem=[64 * mib]) as [(proc, ep)]:
        host, port = rpc_probe._split(ep)
        rss = psutil.Process(proc.pid)
        kids = rss.children(recursive=True)
        rss = kids[0] if kids else rss                       # the server's own process
        with socket.create_connection((host, port), timeout=30) as s:
            rpc_probe._call(s, rpc_probe.CMD_HELLO, bytes(rpc_probe.CAPS), 4 + rpc_probe.CAPS)
            assert _alloc(s, 1 << 30) == 0                                       # 1 GiB claimed: refused
            first = _alloc(s, 40 * mib)
            assert first != 0
            free, total = struct.unpack("<QQ", rpc_probe._call(s, rpc_probe.CMD_GET_DEVICE_MEMORY,
                                                               struct.pack("<I", 0), 16))
            assert total == 64 * mib and free == 24 * mib
            assert _alloc(s, 40 * mib) == 0                                      # 40 + 40 > 64
            s.sendall(struct.pack("<BQQ", 4, 8, first))                          # RPC_CMD_FREE_BUFFER: no answer
            assert _alloc(s, 40 * mib) != 0                                      # its bytes came back
        before = rss.memory_info().rss
        with socket.create_connection((host, port), timeout=30) as s:
            rpc_probe._call(s, rpc_probe.CMD_HELLO, bytes(rpc_probe.CAPS), 4 + rpc_probe.CAPS)
            s.sendall(struct.pack("<BQ", 6, 4 << 30))                            # RPC_CMD_SET_TENSOR of 4 GiB
            s.settimeout(30)
            assert s.recv(1) == b""                                              # dropped, nothing read into memory
        assert rss.memory_info().rss - before < 32 * mib
        assert rpc_probe.probe(ep).devices[0].total == 64 * mib                  # and still serving
