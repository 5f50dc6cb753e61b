#!/usr/bin/env python3
"""Issue 44's hostile requests, timed: grammars, schemas, tool arguments and embeddings that killed or stalled
``serve``.

    python3 benchmarks/serve_hostile_grammars.py [--repo PATH] [--timeout 60]

Starts ``python -m localinfer serve --ctx 2048`` (the embedded SmolLM2-135M) from ``--repo`` (default this
checkout; an older one for the before figures) and sends each case, printing its status (or ``died`` when the
server process exited, ``no reply`` past ``--timeout``), its seconds, the slowest ``/health`` answer while it
ran, and the server's RSS after it.  A server that died is started again for the next case.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parent.parent
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def defs_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 4}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"], "$defs": defs}


def alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


def history(arguments: str) -> list:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


CASES = [
    ("Lark chain of 3,000 rules", "/v1/chat/completions", lambda: {**BASE, "grammar": lark_chain(3000)}),
    ("GBNF chain of 4,000 rules", "/v1/chat/completions", lambda: {**BASE, "grammar": gbnf_chain(4000)}),
    ("JSON schema, 4,000-step $defs chain", "/v1/chat/completions",
     lambda: {**BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                               "schema": defs_chain(4000)}}}),
    ("the same in a tool's parameters", "/v1/chat/completions",
     lambda: {**BASE, "tools": [{"type": "function", "function": {"name": "f", "parameters": defs_chain(4000)}}]}),
    ("20k alternatives (219 KB)", "/v1/chat/completions", lambda: {**BASE, "grammar": alternatives(20_000)}),
    ("60k alternatives (649 KB)", "/v1/chat/completions", lambda: {**BASE, "grammar": alternatives(60_000)}),
    ("150k alternatives (2 MB)", "/v1/chat/completions", lambda: {**BASE, "grammar": alternatives(150_000)}),
    ("tool arguments nested 100k deep", "/v1/chat/completions",
     lambda: {**BASE, "messages": history("[" * 100_000 + "]" * 100_000)}),
    ("tool arguments with a 5,000-digit integer", "/v1/chat/completions",
     lambda: {**BASE, "messages": history('{"n": ' + "9" * 5000 + "}")}),
    ("embeddings, 64 inputs x 1,500 tokens", "/v1/embeddings",
     lambda: {"model": "m", "input": ["hello " * 1500] * 64}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, repo: Path):
        self.repo, self.proc, self.port = repo, None, 0

    def up(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", "--port", str(self.port),
                                      "--ctx", "2048", "--parallel", "2"], cwd=self.repo,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit("serve did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mib(self) -> float | None:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss / 2 ** 20
        except psutil.Error:
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_case(srv: Server, path: str, body: dict, timeout: float) -> dict:
    srv.up()
    result: dict = {}
    worst = [0.0]
    done = threading.Event()

    def probe():
        while not done.is_set():
            t = time.monotonic()
            try:
                httpx.get(srv.url + "/health", timeout=timeout)
                worst[0] = max(worst[0], time.monotonic() - t)
            except httpx.HTTPError:
                worst[0] = max(worst[0], time.monotonic() - t)
                return
            time.sleep(0.1)

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    t = time.monotonic()
    try:
        r = httpx.post(srv.url + path, content=json.dumps(body), timeout=timeout,
                       headers={"content-type": "application/json"})
        result["status"] = str(r.status_code)
        if r.status_code >= 400:
            try:
                result["message"] = r.json()["error"]["message"][:90]
            except (ValueError, KeyError, TypeError):
                result["message"] = r.text[:90]
    except httpx.TimeoutException:
        result["status"] = "no reply"
    except httpx.HTTPError as exc:
        result["status"] = f"{type(exc).__name__}"
    result["seconds"] = time.monotonic() - t
    done.set()
    th.join(timeout)
    time.sleep(0.5)
    if srv.proc.poll() is not None:
        result["status"] += f" (server died, exit {srv.proc.returncode})"
    result["health_max_s"] = worst[0]
    result["rss_mib"] = srv.rss_mib()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=HERE)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    srv = Server(args.repo.resolve())
    rows = []
    try:
        for name, path, make in CASES:
            r = run_case(srv, path, make(), args.timeout)
            rows.append({"case": name, **r})
            rss = f"{r['rss_mib']:.0f}" if r["rss_mib"] else "-"
            print(f"{name:<44} {r['status']:<30} {r['seconds']:6.2f} s  /health max {r['health_max_s']:5.2f} s  "
                  f"RSS {rss:>5} MiB  {r.get('message', '')}", flush=True)
    finally:
        srv.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
