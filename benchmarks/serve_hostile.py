#!/usr/bin/env python3
"""Issue 32's repros, timed: `localinfer serve` from a given checkout against long prompts and hostile clients.

    python3 benchmarks/serve_hostile.py [--repo PATH] [--slow 100] [--slow-s 14]

Starts ``python -m localinfer serve --ctx 4096 -t 1`` (the embedded SmolLM2-135M) from ``--repo`` (default
this checkout; point it at an older one for the before figures) and prints, one line each: the status of a
20 KB chat prompt that fits; deep JSON; a 4 MB completions prompt (status and seconds); a 1-token chat's
latency while six 4 MB prompts are sent; ``--slow`` connections trickling their headers a byte a second for
``--slow-s`` seconds (how many the server closed, and a normal request's latency meanwhile); a POST from a
foreign Origin; a CORS preflight from localhost:3000.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent


def start(repo: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1")
    env.pop("LOCALINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "localinfer", "serve", "--port", "0", "--ctx", "4096", "-t", "1"],
                         cwd=repo, env=env, stderr=subprocess.PIPE, text=True)
    line = ""
    for _ in range(30):
        line = p.stderr.readline()
        if m := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
            url = f"http://127.0.0.1:{m.group(1)}"
            break
    else:
        raise SystemExit(f"the server did not start: {line}")
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not become ready")


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(HERE))
    ap.add_argument("--slow", type=int, default=100)
    ap.add_argument("--slow-s", type=float, default=14.0)
    args = ap.parse_args()
    p, url = start(Path(args.repo))
    chat = url + "/v1/chat/completions"
    c = httpx.Client(timeout=120)
    try:
        model = c.get(url + "/v1/models").json()["data"][0]["id"]       # older servers want the model's name
        msg = {"model": model, "max_tokens": 1, "temperature": 0}
        r = c.post(chat, json={**msg, "messages": [{"role": "user", "content": "hello " * 3400}]})
        print(f"20 KB chat prompt (fits 4096): {r.status_code} {r.json().get('error', {}).get('message', '')[:80]}")
        try:
            r = c.post(chat, content=b"[" * 100_000 + b"]" * 100_000, headers={"content-type": "application/json"})
            print(f"100k-deep JSON: {r.status_code}")
        except httpx.TransportError as exc:
            print(f"100k-deep JSON: {type(exc).__name__} ({exc})")
        big = {"model": model, "prompt": "x" * 4_000_000, "max_tokens": 1}
        r, s = timed(lambda: c.post(url + "/v1/completions", json=big))
        print(f"4 MB completions prompt: {r.status_code} in {s:.2f} s")
        def send_big():
            try:
                httpx.post(url + "/v1/completions", json=big, timeout=120)
            except httpx.TransportError:
                pass                  # a server may answer before reading 4 MB, then reset
        threads = [threading.Thread(target=send_big) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)               # the six bodies are in (4 MB each over loopback), their tokenising begun
        r, s = timed(lambda: c.post(chat, json={**msg, "messages": [{"role": "user", "content": "hi"}]}))
        for t in threads:
            t.join()
        print(f"1-token chat while six 4 MB prompts arrive: {r.status_code} in {s:.2f} s")

        socks = []
        for _ in range(args.slow):
            s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        lat, closed, t0 = [], set(), time.monotonic()
        while time.monotonic() - t0 < args.slow_s:
            for i, s in enumerate(socks):
                if i not in closed:
                    try:
                        s.sendall(b"X")
                    except OSError:
                        closed.add(i)
            try:
                r, dt = timed(lambda: c.post(chat, json={**msg, "messages": [{"role": "user", "content": "hi"}]},
                                             timeout=10))
                lat.append(dt if r.status_code == 200 else float("inf"))
            except httpx.TransportError:
                lat.append(float("inf"))
            time.sleep(1.0)
        for s in socks:
            s.close()
        ok = [x for x in lat if x != float("inf")]
        print(f"{args.slow} connections trickling headers for {args.slow_s:g} s: {len(closed)} closed by the server; "
              f"normal requests {len(ok)}/{len(lat)} answered, max {max(ok) if ok else float('nan'):.2f} s")
        r = c.post(chat, content=json.dumps({**msg, "messages": [{"role": "user", "content": "hi"}]}),
                   headers={"origin": "http://evil.example"})
        print(f"POST from Origin http://evil.example: {r.status_code}")
        r = c.options(chat, headers={"origin": "http://localhost:3000", "access-control-request-method": "POST"})
        print(f"CORS preflight from http://localhost:3000: {r.status_code}")
    finally:
        c.close()
        p.terminate()
        p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
