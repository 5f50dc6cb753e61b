"""Screenshots of `serve`'s chat page and engine view (docs/images/), and the pages' weight and first paint.

    python scripts/screenshots.py [--out docs/images] [--threads 1] [--model PATH]

Starts ``localinfer serve`` on the embedded model (a free port, 4 slots, 8 queued), holds a short conversation
on the chat page in headless Chromium (Debian's ``chromium``, driven by playwright), then opens the engine
view and sends a burst of 16 requests with one system prompt (4 run, 8 queue, 4 are refused with 429),
taking the screenshot mid-burst (4 running, some queued, the first 4 finished).  Prints what the engine view showed, each page's weight (the HTML and the
files it loads, in bytes) and its first contentful paint (median of 5 fresh loads).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.browser import ARGS, chromium_path

SYSTEM = ("You are a concise assistant for a cooking school. Answer in one short sentence, and never use lists "
          "or headings in the answer.")
TOPICS = ["bread", "rice", "soup", "eggs", "pasta", "tea", "salad", "beans", "cake", "fish", "curry", "pie",
          "tofu", "jam", "corn", "stew"]


def start(model: str | None, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "localinfer", "serve", *([model] if model else []), "--port", "0",
           "--parallel", "4", "--max-queue", "8", "--ctx", "4096", "-t", str(threads)]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for _ in range(20):
        line = p.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            break
    else:
        raise SystemExit("the server did not start")
    url = f"http://127.0.0.1:{m.group(1)}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not become ready")


def wait(page, js: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while not (value := page.evaluate(js)):
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {js}")
        time.sleep(0.05)
    return value


def weight(url: str, path: str) -> int:
    html = httpx.get(url + path).content
    files = re.findall(rb'(?:src|href)="(/static/[^"]+)"', html)
    return len(html) + sum(len(httpx.get(url + f.decode()).content) for f in files)


def first_paint(browser, url: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        ctx = browser.new_context()
        page = ctx.new_page()
        page.goto(url, wait_until="load")
        fcp = wait(page, "() => { const e = performance.getEntriesByName('first-contentful-paint')[0];"
                         " return e ? e.startTime : 0; }", 10)
        times.append(fcp)
        ctx.close()
    return statistics.median(times)


def chat(page, url: str, out: Path) -> None:
    page.goto(url + "/")
    wait(page, "() => document.getElementById('model').textContent.includes('tokens')")
    page.fill("#system", "You are a helpful programming assistant.")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "120")
    for text in ("What is a prime number? One sentence.", "Write a Python function that checks it."):
        page.fill("#input", text)
        page.click("#send")
        time.sleep(0.2)
        wait(page, "() => { const m = document.querySelectorAll('.msg.assistant');"
                   " return m.length && m[m.length - 1].dataset.finish; }", 120)
    page.screenshot(path=str(out / "chat.png"))


def engine(page, url: str, out: Path) -> dict:
    page.goto(url + "/engine")
    wait(page, "() => window.LI && LI.engine && LI.engine.polls >= 1")
    statuses: list[int] = []
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    threads = [threading.Thread(target=ask, args=(url, model, t, statuses)) for t in TOPICS]
    for t in threads:
        t.start()
    seen = []
    shot = False
    while any(t.is_alive() for t in threads):
        s = page.evaluate("() => LI.engine.last && LI.engine.last.snapshot")
        if s:
            seen.append({"running": s["running"], "waiting": s["waiting"], "used": s["pool"]["used"],
                         "shared": s["pool"]["shared"], "parked": s["parked"]["sequences"],
                         "chunks": max((len(x["chunks"]) for x in s["steps"][-5:]), default=0)})
            # mid-burst, once the first answers are in: 4 running, some queued, some finished
            if not shot and s["running"] == 4 and s["waiting"] >= 1 and len(s["finished"]) >= 4:
                time.sleep(0.6)
                page.screenshot(path=str(out / "engine.png"), full_page=True)
                shot = True
        time.sleep(0.25)
    for t in threads:
        t.join()
    time.sleep(1.5)
    if not shot:
        page.screenshot(path=str(out / "engine.png"), full_page=True)
    final = page.evaluate("() => LI.engine.last.snapshot")
    m = final["metrics"]
    steps = [x for x in final["steps"] if x["measured_s"] and x["predicted_s"]]
    return {"statuses": {c: statuses.count(c) for c in set(statuses)},
            "most_running": max(x["running"] for x in seen), "most_queued": max(x["waiting"] for x in seen),
            "most_blocks_used": max(x["used"] for x in seen), "most_shared_blocks": max(x["shared"] for x in seen),
            "most_chunks_in_a_step": max(x["chunks"] for x in seen), "parked_after": final["parked"]["sequences"],
            "prefix_hit_rate": m["localinfer_prefix_cache_hit_tokens_total"] / m["localinfer_prompt_tokens_total"],
            "preemptions": m["localinfer_preemptions_total"], "steps": m["localinfer_engine_steps_total"],
            "step_model_mean_abs_error": statistics.mean(abs(x["predicted_s"] - x["measured_s"]) / x["measured_s"]
                                                         for x in steps) if steps else None}


def ask(url: str, model: str, topic: str, statuses: list) -> None:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"How to cook {topic}?"}]})
    statuses.append(r.status_code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "images"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if chromium_path() is None:
        raise SystemExit("chromium is not installed (./install.sh test installs it as root)")
    from playwright.sync_api import sync_playwright

    server, url = start(args.model, args.threads)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            chat(page, url, out)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            burst = engine(page, url, out)
            figures = {"page_bytes": {p: weight(url, p) for p in ("/", "/engine")},
                       "first_contentful_paint_ms": {p: round(first_paint(browser, url + p), 1)
                                                     for p in ("/", "/engine")},
                       "burst": burst}
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
