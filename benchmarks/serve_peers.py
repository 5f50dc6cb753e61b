"""localinfer serve beside llama.cpp's llama-server and llama-cpp-python's server, one run, same load.

    python benchmarks/serve_peers.py --llama-server PATH|build [--llama-cpp-python PYTHON|venv] \
        [--scenarios closed,prefix,poisson] [--rounds N] [--levels LIST] [--out benchmarks/results/serve_peers_cpu]

``--llama-server build`` builds the peer from the llama.cpp sources vendored in the installed
llama-cpp-python's sdist (``scripts/build_llama_server.sh``: this CPU's SIMD flags, no web UI; about 16
minutes on 2 cores, then cached); ``--llama-cpp-python venv`` makes a virtual environment over this one
(``--system-site-packages``, so the installed llama-cpp-python is reused) with its ``[server]`` extras.

Every server runs the same model (default: the embedded SmolLM2 Q4_1) with the same threads, the same
total context and flash attention on; each is started once per scenario and left idle while the others
are measured.  Each load level goes to every server in turn, before the next level, so the other work
on a shared machine falls on all of them alike.  ``--rounds N`` runs each level N times, fresh prompts each
round and the servers' order rotated, and adds the median of the rounds' ratios: on a shared host a slow
minute moves one run's ratio by 5-15%, so a target is judged on the median (``--levels`` picks levels).
The load is ``benchmarks/serve_load.py`` (the same code as ``localinfer bench serve``), run once per
server, level and round, fresh prompts per level and round.  ``--variant-arg FLAG`` / ``--variant-env VAR=VALUE``
add a second localinfer server (``localinfer-b``) with that flag or environment, measured in the same rounds: an
A/B of a setting that cancels the host's drift as the peers' ratios do; ``--variant-env PYTHONPATH=<a worktree>``
runs that tree's code (the servers start in a directory of their own, this checkout first on their path).

Scenarios (issue 15's measurements):

- ``closed``: closed loop at concurrency 1, 4, 8; 16 requests of about 300 prompt tokens, 128 output
  tokens with EOS ignored; total context 4096 over 8 slots (llama-server ``-np 8 --kv-unified``).
- ``prefix``: concurrency 4, every prompt starting with the same 1,000-token system prefix (1,300 tokens
  in all); total context 8192 over 8 slots.  Reports TTFT and the peak KV cells in use: localinfer's
  ``localinfer_kv_blocks_used`` × 16 (an upper bound on its cells), llama-server's Σ over busy slots of
  prompt + generated tokens from ``/slots`` (each slot holds its own copy of the prefix).
- ``poisson``: open-loop Poisson arrivals at rates that overload the machine, 10 s TTFT and end-to-end
  SLOs; every request carries a 10 s deadline (``x-localinfer-deadline-ms``, which only localinfer reads:
  it refuses at admission what it predicts would be late).  Goodput as vLLM defines it.

llama-cpp-python's server has no ``ignore_eos``: it gets ``min_tokens`` (= output tokens) instead, and
``--interrupt_requests False`` (its default cuts a running stream to one token when another request
waits).  Its other settings are its defaults (``logits_all`` on among them).  Writes OUT.json (every
run's full figures, the machine, the commands) and OUT.txt (the table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from localinfer.model.sources import resolve_model

SCENARIOS = {
    "closed": {"ctx": 4096, "levels": [["--concurrency", "1"], ["--concurrency", "4"], ["--concurrency", "8"]],
               "load": ["--requests", "16", "--prompt-tokens", "300", "--output-tokens", "128"]},
    "prefix": {"ctx": 8192, "levels": [["--concurrency", "4"]],
               "load": ["--requests", "16", "--prompt-tokens", "1300", "--shared-prefix", "1000",
                        "--output-tokens", "128"]},
    "poisson": {"ctx": 4096, "levels": [["--concurrency", "", "--rate", "0.6"], ["--concurrency", "", "--rate", "1.0"]],
                "load": ["--requests", "40", "--prompt-tokens", "300", "--output-tokens", "128",
                         "--slo-ttft", "10", "--slo-e2e", "10", "--deadline-ms", "10000"]},
}


# every server a run may start; the first is the one measured, the table gives its figures over each other's
SERVERS = ("localinfer", "llama-server", "llama-cpp-python", "localinfer-b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(args, model: str, ctx: int, ports: dict[str, int]) -> dict[str, list[str]]:
    """Each server's command line.  ``args``: ``threads`` and ``llama_server``; the other scripts that start these
    servers (serve_nkv, serve_prefix_trace, serve_threads) may leave out ``serve_arg``, ``variant_arg``,
    ``variant_env`` and ``llama_cpp_python``."""
    t = str(args.threads)
    serve_arg, variant_arg, variant_env = (getattr(args, k, None) or [] for k in ("serve_arg", "variant_arg",
                                                                                  "variant_env"))
    out = {"localinfer": [sys.executable, "-m", "localinfer", "serve", model, "--port", str(ports["localinfer"]),
                          "--parallel", "8",
                          "--ctx", str(ctx), "-t", t, "-fa", "on", "--max-queue", "1024", *serve_arg]}
    if variant_arg or variant_env:      # the same server with other flags or environment, as a peer
        b = [*out["localinfer"], *variant_arg]
        b[b.index("--port") + 1] = str(ports["localinfer-b"])
        out["localinfer-b"] = ["env", *variant_env, *b]
    if args.llama_server:
        out["llama-server"] = [args.llama_server, "-m", model, "--host", "127.0.0.1",
                               "--port", str(ports["llama-server"]),
                               "-c", str(ctx), "-np", "8", "--kv-unified", "--no-webui", "-t", t, "-tb", t,
                               "-fa", "on", "--metrics"]
    if getattr(args, "llama_cpp_python", None):
        out["llama-cpp-python"] = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", model,
                                   "--host", "127.0.0.1", "--port", str(ports["llama-cpp-python"]),
                                   "--n_ctx", str(ctx),
                                   "--n_threads", t, "--n_threads_batch", t, "--flash_attn", "True",
                                   "--interrupt_requests", "False"]
    return out


def peers(args) -> None:
    """Resolve ``--llama-server build`` and ``--llama-cpp-python venv`` into the paths they make (cached)."""
    if args.llama_server == "build":
        done = subprocess.run([str(ROOT / "scripts" / "build_llama_server.sh")], stdout=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit("serve_peers: llama-server could not be built (see the message above)")
        args.llama_server = done.stdout.strip()
    if args.llama_cpp_python == "venv":
        from importlib.metadata import version
        ver = version("llama-cpp-python")
        env = Path(os.environ.get("LOCALINFER_CACHE", Path.home() / ".cache" / "localinfer"))
        env = env / f"llama-cpp-python-server-{ver}"
        py = env / "bin" / "python"
        ready = py.exists() and subprocess.run([str(py), "-c", "import llama_cpp.server.app"],
                                               capture_output=True).returncode == 0
        if not ready:
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            f"llama-cpp-python[server]=={ver}"], check=True)
        args.llama_cpp_python = str(py)


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}: {log.read_text()[-800:]}")
        try:   # /v1/models may answer while the model loads; /health says when it is ready (where it exists)
            if (httpx.get(url + "/models", timeout=2).status_code == 200
                    and httpx.get(url.removesuffix("/v1") + "/health", timeout=2).status_code in (200, 404)):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    sys.exit(f"{url} did not become ready: {log.read_text()[-800:]}")


def stop(*procs: subprocess.Popen) -> None:
    """SIGTERM every server, then wait for each (30 s, then kill)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


SMOKE = {"--requests": "3", "--output-tokens": "8"}     # --smoke: the same runs, tiny


def load_flags(args, scenario: dict) -> list[str]:
    flags = list(scenario["load"])
    if args.smoke:
        for k, v in SMOKE.items():
            flags[flags.index(k) + 1] = v
    return flags


def load(args, name: str, url: str, scenario: dict, level: list[str], tmp: Path, seed: int) -> dict:
    """One serve_load.py run; ``seed`` draws this level's prompts (the same for every server, new per level,
    so no server answers a level from its cache of the last one)."""
    out = tmp / f"{name}.json"
    flags = load_flags(args, scenario) + ["--seed", str(seed)]
    extra = ["--extra-body", json.dumps({"min_tokens": int(flags[flags.index("--output-tokens") + 1])})
             ] if name == "llama-cpp-python" else []
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", url, "--label", name,
           *flags, *level, *extra, "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=3600)
    return json.loads(out.read_text())


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def absolute_paths(assignment: str) -> str:
    """``PYTHONPATH=../wt`` as ``PYTHONPATH=/abs/wt``: the servers start elsewhere, where a relative entry would
    name nothing and the variant would quietly run the installed code."""
    var, _, value = assignment.partition("=")
    if var != "PYTHONPATH":
        return assignment
    return var + "=" + os.pathsep.join(os.path.abspath(p) for p in value.split(os.pathsep) if p)


def server_env() -> dict[str, str]:
    """The servers' environment: this one, with this checkout first on PYTHONPATH (a variant's ``env`` sets its own)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


@contextlib.contextmanager
def running(cmds: dict[str, list[str]], urls: dict[str, str], tmp: Path, tag: str = ""):
    """Every server of ``cmds`` started (its log ``tmp/<tag><name>.log``) and ready at its URL; all stopped after."""
    procs = {}
    try:
        for name, cmd in cmds.items():
            log = tmp / f"{tag}{name}.log"
            # from a directory of their own, this checkout first on the path: ``python -m localinfer`` would put the
            # caller's directory ahead of a variant's PYTHONPATH (an A/B of a worktree ran the caller's code twice)
            procs[name] = (subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp,
                                            env=server_env()), log)
        for name, (proc, log) in procs.items():
            wait_ready(urls[name], proc, log)
        yield
    finally:
        stop(*(proc for proc, _ in procs.values()))


def add_localinfer_arguments(ap: argparse.ArgumentParser) -> None:
    """--serve-arg, --variant-arg and --variant-env (a second localinfer serve, 'localinfer-b', as a peer)."""
    ap.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                    help="one more argument for localinfer serve (repeatable), e.g. --serve-arg=--max-gap=off")
    ap.add_argument("--variant-arg", action="append", default=[], metavar="FLAG",
                    help="run a second localinfer serve with this flag added (repeatable), 'localinfer-b': its "
                         "ratios are the default's over the variant's")
    ap.add_argument("--variant-env", action="append", default=[], metavar="VAR=VALUE",
                    help="the variant server's environment (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE or "
                         "PYTHONPATH=/path/to/a/worktree")


def check_variant_env(ap: argparse.ArgumentParser, args) -> None:
    """Refuse a --variant-env that is not VAR=VALUE; make a PYTHONPATH in it absolute."""
    if bad := [v for v in args.variant_env if "=" not in v or not v.split("=", 1)[0]]:
        ap.error(f"--variant-env takes VAR=VALUE, got {bad[0]!r}")
    args.variant_env = [absolute_paths(v) for v in args.variant_env]


def run_scenario(args, model: str, key: str, tmp: Path) -> dict:
    scenario = SCENARIOS[key]
    ports = {name: free_port() for name in SERVERS}
    cmds = commands(args, model, scenario["ctx"], ports)
    url_of = lambda name: f"http://127.0.0.1:{ports[name]}/v1"
    with running(cmds, {name: url_of(name) for name in cmds}, tmp, f"{key}-"):
        levels = []
        for li, level in enumerate(scenario["levels"]):
            label = level_label(level)
            if args.levels and label not in args.levels:
                continue
            names = list(cmds)
            for rnd in range(args.rounds):
                row = {"level": label, "round": rnd + 1}
                # round r starts at server r: a slow spell of the shared host falls on each server in turn
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    print(f"{key} {label} round {rnd + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                    seed = 1 + 100 * list(SCENARIOS).index(key) + li + 1000 * rnd
                    doc = load(args, name, url_of(name), scenario, level, tmp, seed)
                    row[name] = {"run": doc["runs"][0], "machine": doc["machine"]}
                levels.append({"level": label, "round": rnd + 1, **{n: row[n] for n in names}})   # servers in order
        return {"scenario": key, "ctx": scenario["ctx"], "load": load_flags(args, scenario), "commands": cmds,
                "levels": levels}


def write_results(out: str, doc: dict, text: str) -> None:
    """OUT.json (``doc``) and OUT.txt (``text``), each written whole (a temporary file, then a rename)."""
    for suffix, body in ((".json", json.dumps(doc, indent=1) + "\n"), (".txt", text + "\n")):
        path = Path(out + suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_suffix(path.suffix + ".tmp")
        tmp_path.write_text(body)
        os.replace(tmp_path, path)


def level_label(level: list[str]) -> str:
    return " ".join(x for x in level if x).replace("--concurrency --rate", "--rate")


def ratios(rows: list[dict], peer: str) -> str:
    """localinfer's figures over ``peer``'s: the median over ``rows`` (rounds of one level) of each row's ratio."""
    def med(key, of=lambda run, key: run.get(key)):
        got = [a / b for row in rows if (a := of(row["localinfer"]["run"], key)) and (b := of(row[peer]["run"], key))]
        of_all = "" if len(got) == len(rows) else f" ({len(got)} of {len(rows)})"    # rounds with both figures
        return f"{statistics.median(got):.2f}x{of_all}" if got else "-"

    cells = lambda run, _: run.get("peaks", {}).get("localinfer_kv_blocks_used") or \
        run.get("peaks", {}).get("llama_server_slot_tokens")
    return (f"tok/s {med('output_tok_s')}  TTFT p50 {med('ttft_p50_ms')}  p95 {med('ttft_p95_ms')}"
            f"  ITL p50 {med('itl_p50_ms')}"
            f"  ITL p99 {med('itl_p99_ms')}  max gap {med('gap_max_ms')}  e2e p95 {med('e2e_p95_ms')}"
            f"  goodput {med('goodput_req_s')}  cells {med(None, cells)}")


def _load(run: dict) -> str:
    """The 1-minute load average when that run began (serve_load.py's machine record)."""
    m = run.get("machine") or {}
    got = m.get("loadavg_before") or m.get("loadavg_1_5_15")
    return f"{got[0]:.2f}" if got else "-"


def table(results: list[dict]) -> str:
    lines = []
    for sc in (sc for sc in results if sc["levels"]):
        lines.append(f"\n[{sc['scenario']}] ctx {sc['ctx']}, {' '.join(sc['load'])}")
        names = [n for n in SERVERS if n in sc["levels"][0]]
        head = (f"{'level':<21}{'server':<18}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p95':>10}{'ITL p50':>9}"
                f"{'p99':>8}{'p99.9':>8}{'max gap':>9}{'e2e p50':>9}{'p95':>8}{'p99':>8}"
                f"{'good/s':>8}{'ok':>7}{'peak cells':>11}{'load':>6}")
        lines.append(head)
        for row in sc["levels"]:
            for n in names:
                r = row[n]["run"]
                p = r.get("peaks", {})
                cells = p.get("localinfer_kv_blocks_used") or p.get("llama_server_slot_tokens")
                level = row["level"] + (f" #{row['round']}" if row.get("round", 1) > 1 else "")
                ms = lambda key, w: f"{r.get(key) or 0:>{w - 2}.0f}ms"
                lines.append(f"{level:<21}{n:<18}{r['output_tok_s']:>8.1f}"
                             f"{(r['ttft_p50_ms'] or 0) / 1e3:>9.2f}s{(r['ttft_p95_ms'] or 0) / 1e3:>9.2f}s"
                             f"{ms('itl_p50_ms', 9)}{ms('itl_p99_ms', 8)}{ms('itl_p99.9_ms', 8)}{ms('gap_max_ms', 9)}"
                             f"{(r['e2e_p50_ms'] or 0) / 1e3:>8.2f}s{(r['e2e_p95_ms'] or 0) / 1e3:>7.2f}s"
                             f"{(r['e2e_p99_ms'] or 0) / 1e3:>7.2f}s{r['goodput_req_s']:>8.3f}"
                             f"{r['ok']:>4}/{r['requests']:<3}{cells if cells else '-':>10}{_load(row[n]):>6}")
            for n in names[1:]:
                lines.append(f"{'':<21}{'ratio vs ' + n:<34}" + ratios([row], n))
            rounds = [r for r in sc["levels"] if r["level"] == row["level"]]
            if len(rounds) > 1 and row is rounds[-1]:
                for n in names[1:]:
                    lines.append(f"{'':<21}{f'median of {len(rounds)} vs ' + n:<34}" + ratios(rounds, n))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--llama-server", default=None, metavar="PATH|build",
                    help="path of a llama-server binary, or 'build' to build it (cached)")
    ap.add_argument("--llama-cpp-python", default=None, metavar="PYTHON|venv",
                    help="a Python that has llama-cpp-python[server] (run as PYTHON -m llama_cpp.server), or "
                         "'venv' to make one over this environment (cached)")
    ap.add_argument("--scenarios", default="closed,prefix,poisson")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each level this many times, fresh prompts each round, the servers' order rotated; "
                         "the table adds the median of the rounds' ratios")
    ap.add_argument("--levels", default=None, metavar="LIST",
                    help="comma-separated levels to run, as the table names them (e.g. '--concurrency 4')")
    add_localinfer_arguments(ap)
    ap.add_argument("--out", default="benchmarks/results/serve_peers_cpu")
    ap.add_argument("--smoke", action="store_true", help=f"tiny loads ({SMOKE}): checks the script runs")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    check_variant_env(ap, args)
    model = str(resolve_model(args.model).resolve())      # the servers run in a directory of their own
    keys = [k for k in args.scenarios.split(",") if k]
    bad = [k for k in keys if k not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; use {','.join(SCENARIOS)}")
    args.levels = [x.strip() for x in args.levels.split(",") if x.strip()] if args.levels else None
    known = {level_label(level) for k in keys for level in SCENARIOS[k]["levels"]}
    if args.levels and (unknown := [x for x in args.levels if x not in known]):
        ap.error(f"unknown level(s) {unknown}; the chosen scenarios have {sorted(known)}")
    peers(args)
    for peer in ("llama_server", "llama_cpp_python"):      # a relative program path would resolve in that directory
        if getattr(args, peer) and os.sep in getattr(args, peer):
            setattr(args, peer, os.path.abspath(getattr(args, peer)))
    before = machine()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_scenario(args, model, k, Path(tmp)) for k in keys
                   if not args.levels or {level_label(lv) for lv in SCENARIOS[k]["levels"]} & set(args.levels)]
    doc = {"machine": dict(machine(), loadavg_before=before["loadavg_1_5_15"]), "model": model,
           "rounds": args.rounds, "levels": args.levels,
           "threads": args.threads, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "scenarios": results}
    text = table(results)
    write_results(args.out, doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
