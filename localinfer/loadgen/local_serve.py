"""Start ``localinfer serve`` in a child process for a load test (``bench serve MODEL``), and stop it.

The child binds a free port (``--port 0``) and prints its address on stderr; a thread keeps reading that
stream (so the child never blocks on a full pipe) and keeps its last lines for the error when it does not
start.  Ready means ``GET /health`` answers 200.  Leaving the ``with`` block sends SIGTERM, which lets
in-flight requests finish within serve's grace period, and kills the child if it outlives that.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import threading
import time

from localinfer.errors import BackendUnavailableError, RemoteServerError

ADDRESS = re.compile(r"(http://127\.0\.0\.1:\d+/v1)")


class LocalServe:
    """``with LocalServe(model, threads=2, ctx=4096, parallel=8) as url:`` a ready server's base URL (``.../v1``)."""

    def __init__(self, model: str | None = None, *, threads: int = 2, ctx: int = 4096, parallel: int = 8,
                 extra: list[str] | tuple[str, ...] = (), ready_s: float = 300.0, stop_s: float = 60.0):
        self.cmd = [sys.executable, "-m", "localinfer", "serve", *([model] if model else []), "--port", "0",
                    "--parallel", str(parallel), "--ctx", str(ctx), "-t", str(threads), "--max-queue", "1024",
                    *extra]
        self.ready_s, self.stop_s = ready_s, stop_s
        self.url: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc: subprocess.Popen | None = None
        self._found = threading.Event()
        self._reader: threading.Thread | None = None

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            if self.url is None and (m := ADDRESS.search(line)):
                self.url = m.group(1)
                self._found.set()
        self._found.set()

    def _failed(self, what: str) -> RemoteServerError:
        lines = [t for t in self.tail if t.strip()]
        error = next((t for t in reversed(lines) if t.startswith("error:")), lines[-1] if lines else "")
        hint = next((t[5:].strip() for t in reversed(lines) if t.startswith("hint:")), None)
        why = f": {error.removeprefix('error:').strip()}" if error else ""
        return RemoteServerError(f"localinfer serve {what}{why}", command=" ".join(self.cmd),
                                 hint=hint or "run the same `localinfer serve` by hand to see why")

    def __enter__(self) -> str:
        try:
            import httpx
        except ImportError:
            raise BackendUnavailableError("load testing a server needs the httpx package",
                                          hint="pip install httpx") from None
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        try:
            deadline = time.monotonic() + self.ready_s
            if not self._found.wait(self.ready_s) or self.url is None:   # set at the address line or at EOF
                raise self._failed("did not start")
            health = self.url.removesuffix("/v1") + "/health"
            while True:
                try:
                    if httpx.get(health, timeout=2).status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
                if self.proc.poll() is not None:
                    self._reader.join(5)
                    raise self._failed(f"exited (status {self.proc.returncode}) while loading")
                if time.monotonic() > deadline:
                    raise self._failed(f"was not ready within {self.ready_s:g} s")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)

    def __exit__(self, *exc) -> None:
        self.stop()
