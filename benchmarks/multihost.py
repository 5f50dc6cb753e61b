"""Split across llama.cpp RPC workers: tok/s local vs one and two loopback workers, measured against predicted.

The prediction is ``plan.split.split_speed`` calibrated on the local run (each stage takes its share of the
weights of the measured local time) plus the network per token on the link: the ``loopback`` profile, and
the link as measured here (a TCP ping-pong for the round trip, a bulk transfer for the bandwidth).  With
``--netem`` (root, ``ip netns``), one more run puts a worker behind an emulated 1 GbE link (a veth pair
into a namespace this script creates, netem 0.1 ms each way = 0.2 ms RTT, rate 1 Gbit/s; where the kernel
has no netem, a tbf rate limit alone) against the ``1gbe`` profile and against 1 GbE's rate with the
round trip measured on the veth.  Every worker runs 1 thread; the client 1 thread.

    python benchmarks/multihost.py [--tokens 64] [--prompt 128] [--netem] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localinfer.devices.links import Link, get_link
from tests.support.rpc_workers import stop, workers

NS, VETH_HOST, VETH_NS = "li31ns", "li31a", "li31b"
HOST_IP, NS_IP = "10.231.31.1", "10.231.31.2"


_ECHO = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(1); print(s.getsockname()[1],"
         "flush=True); c,_=s.accept(); c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
         "n=int(sys.argv[2])\nfor _ in range(n): c.sendall(c.recv(1))\nleft=int(sys.argv[3])\n"
         "while left>0: left-=len(c.recv(1<<20))\nc.sendall(b'k')")


def measure_link(host: str = "127.0.0.1", n: int = 2000, bulk: int = 64 << 20, netns: str | None = None) -> Link:
    """Round trip (1-byte ping-pong) and one-way bulk bandwidth of TCP to a process on ``host`` (in ``netns``)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen([*prefix, sys.executable, "-c", _ECHO, host, str(n), str(bulk)], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection((host, port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            for _ in range(n):
                c.sendall(b"x")
                c.recv(1)
            rtt = (time.perf_counter() - t0) / n
            chunk = bytes(1 << 20)
            t0 = time.perf_counter()
            for _ in range(bulk >> 20):
                c.sendall(chunk)
            c.recv(1)
            bw = bulk / (time.perf_counter() - t0)
    finally:
        stop(proc)
    return Link(f"measured {host}", f"measured TCP to {host}", bw, rtt, {"bandwidth": "measured", "rtt": "measured"})


def open_engine(model: str, endpoints: list[str], shares=None):
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.registry import load_engine

    opts = {"rpc": tuple(endpoints)} if endpoints else {}
    if shares:
        opts["tensor_split"] = shares
    t0 = time.perf_counter()
    eng = load_engine(LoadPlan(model, n_ctx=1024, n_threads=1, options=opts))
    return eng, time.perf_counter() - t0


def measure(eng, tokens: int, prompt_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one greedy generation from an empty cache."""
    from localinfer.generation.runner import Runner
    from localinfer.generation.sampling import SamplingParams

    prompt = eng.tokenize("The history of the city begins with a small village by the river. " * 40,
                          add_bos=True)[:prompt_tokens]
    eng.trim(0, 0)
    last = None
    for chunk in Runner(eng).stream(prompt, SamplingParams(greedy=True), max_tokens=tokens, ignore_eos=True):
        last = chunk
    return last.timings.prefill_tok_s, last.timings.decode_tok_s


def predict(model: str, endpoints: list[str], local: dict, link: Link, shares=None,
            rpc_overhead_s: float | None = None) -> dict:
    from localinfer.backends.engine import LoadPlan
    from localinfer.backends.llamacpp.rpc_probe import probe
    from localinfer.commands._common import plan_request
    from localinfer.model.spec import ModelSpec
    from localinfer.plan.split import fit_split
    from localinfer.plan.split_devices import from_workers

    spec = ModelSpec.from_gguf(model)
    setup = from_workers([probe(ep) for ep in endpoints])
    req = plan_request(spec, LoadPlan(model, n_ctx=1024))
    sf = fit_split(spec, setup.devices, req, shares=shares, search=False, link=link, remote=setup.remote,
                   calibration={"decode_s": 1 / local["decode_tok_s"], "prefill_tok_s": local["prefill_tok_s"],
                                **({} if rpc_overhead_s is None else {"rpc_overhead_s": rpc_overhead_s})})
    sp = sf.speed
    return {"decode_tok_s": sp.decode_tok_s, "network_ms_per_token": sp.network_s * 1e3,
            "round_trips": sp.round_trips, "token_bytes": sp.token_bytes, "counts": sf.breakdown.counts()}


@contextlib.contextmanager
def netem_worker(rtt_ms: float = 0.2, rate: str = "1gbit"):
    """A worker in a namespace behind a veth pair with netem on both ends; yields its endpoint."""
    def sh(*cmd):
        subprocess.run(cmd, check=True, capture_output=True)

    proc = None
    try:
        sh("ip", "netns", "add", NS)
        sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        sh("ip", "link", "set", VETH_NS, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", VETH_HOST)
        sh("ip", "link", "set", VETH_HOST, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", VETH_NS)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", VETH_NS, "up")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        half = f"{rtt_ms / 2}ms"
        try:
            sh("tc", "qdisc", "add", "dev", VETH_HOST, "root", "netem", "delay", half, "rate", rate)
            sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", VETH_NS, "root", "netem", "delay", half,
               "rate", rate)
            shaping = f"netem {half} each way, rate {rate}"
        except subprocess.CalledProcessError:   # no sch_netem in this kernel: shape the rate only (tbf)
            tbf = ("tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
            sh("tc", "qdisc", "add", "dev", VETH_HOST, "root", *tbf)
            sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", VETH_NS, "root", *tbf)
            shaping = f"tbf rate {rate} (netem unavailable: no delay added)"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        port = 50231
        proc = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-m", "localinfer", "worker", "--host",
                                 NS_IP, "--port", str(port), "--allow-remote", "-t", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        from localinfer.backends.llamacpp.rpc_probe import listening

        ep = f"{NS_IP}:{port}"
        for _ in range(300):
            if listening(ep, 0.2):
                break
            time.sleep(0.1)
        yield ep, shaping
    finally:
        if proc is not None:
            stop(proc)
        subprocess.run(["ip", "link", "del", VETH_HOST], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], check=False, capture_output=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--netem", action="store_true", help="also a worker behind an emulated 1 GbE link (root)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from localinfer.model.sources import resolve_model

    model = str(resolve_model(None))
    lo = measure_link()
    with contextlib.ExitStack() as stack:
        ws = [ep for _, ep in stack.enter_context(workers(3))]
        setups = {"local (1 thread)": [], "1 loopback worker": ws[:1], "2 loopback workers": ws[1:]}
        shaping = None
        if args.netem:
            ep, shaping = stack.enter_context(netem_worker())
            veth = measure_link(ep.rsplit(":", 1)[0], netns=NS)
            rtt = veth.rtt_s
            setups[f"1 worker over a veth pair ({shaping})"] = [ep]
        engines = {}
        for name, eps in setups.items():
            eng, load_s = open_engine(model, eps)
            stack.callback(eng.close)
            engines[name] = (eng, load_s)
        runs = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, (eng, _) in engines.items():
                runs[name].append(measure(eng, args.tokens, args.prompt))
        load_avg = os.getloadavg()
        rows = []
        for name, (eng, load_s) in engines.items():
            pre = statistics.median(r[0] for r in runs[name])
            dec = statistics.median(r[1] for r in runs[name])
            rows.append({"setup": name, "prefill_tok_s": pre, "decode_tok_s": dec, "load_s": load_s,
                         "decode_tok_s_runs": [r[1] for r in runs[name]]})
        for eng, _ in engines.values():     # predict() probes the workers: one client at a time
            eng.close()
        local = rows[0]
        for row in rows[1:]:
            eps = setups[row["setup"]]
            links = [get_link("loopback"), lo] if "loopback" in row["setup"] else \
                [get_link("1gbe"), Link("veth", "1 GbE rate, RTT measured on the veth", get_link("1gbe").bandwidth,
                                        rtt, {})]
            for link in links:
                row[f"predicted ({link.name})"] = predict(model, eps, local, link)
            row["measured_ms_per_token_over_local"] = (1 / row["decode_tok_s"] - 1 / local["decode_tok_s"]) * 1e3
    hop = hop_overhead(args.rounds, lo)
    doc = {"machine": f"{platform.machine()} {os.cpu_count()} vCPU, Python {platform.python_version()}",
           "load_average": load_avg, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "model": os.path.basename(model), "tokens": args.tokens, "prompt": args.prompt, "rounds": args.rounds,
           "loopback_measured": {"rtt_ms": lo.rtt_s * 1e3, "MB_s": lo.bandwidth / 1e6}, "rows": rows,
           "hop_overhead": hop}
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def hop_overhead(rounds: int, link: Link, tokens: int = 200) -> list[dict]:
    """The per-token cost of a hop alone: a 2-layer, 64-wide model (compute ≈ 0) local vs over 1 and 2 workers."""
    import tempfile

    from tests.support.ggufgen import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp, workers(3) as ws:
        model = str(write_tiny_model(Path(tmp) / "tiny.gguf", n_layers=2, n_embd=64, n_ff=128, n_head=2,
                                     n_head_kv=1))
        eps = [ep for _, ep in ws]
        setups = {"local": [], "1 worker": eps[:1], "2 workers": eps[1:]}
        engines = {name: open_engine(model, e)[0] for name, e in setups.items()}
        try:
            runs = {name: [] for name in setups}
            for _ in range(rounds):
                for name, eng in engines.items():
                    runs[name].append(1e3 / measure(eng, tokens, 8)[1])
        finally:
            for eng in engines.values():
                eng.close()
        base = statistics.median(runs["local"])
        out = [{"setup": "tiny local", "ms_per_token": base}]
        for name in ("1 worker", "2 workers"):
            p = predict(model, setups[name], {"decode_tok_s": 1e3 / base, "prefill_tok_s": 1e6}, link,
                        rpc_overhead_s=0.0)
            ms = statistics.median(runs[name])
            out.append({"setup": f"tiny over {name}", "ms_per_token": ms, "measured_overhead_ms": ms - base,
                        "predicted_rtt_and_bytes_ms": p["network_ms_per_token"], "round_trips": p["round_trips"],
                        "token_bytes": p["token_bytes"]})
        return out


if __name__ == "__main__":
    sys.exit(main())
