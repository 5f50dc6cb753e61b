"""How fast `localinfer inspect` reads an 80 GiB model, and how few bytes it reads.

Writes a Qwen3-235B-A22B Q2_K skeleton (79.8 GiB, sparse: no disk used), once
with the skeleton's small header and once with a synthetic 151,936-token
vocabulary that gives the header its real size (≈6 MB), then measures:

* the whole command, ``localinfer inspect FILE`` in a fresh process (wall time),
* the header parse alone, ours (``read_header`` + ``account``) vs ``gguf.GGUFReader``,
* bytes read from the model file: our reader's own count and the read() syscall
  bytes (``rchar`` in /proc/self/io) during the parse; GGUFReader maps the file,
  so for it the pages of the file it touched (Rss of the mapping) are reported.

Usage: python benchmarks/inspect_speed.py [--repeat N] [--json OUT] [--dir DIR]
Targets: whole command < 0.3 s wall, < 10 MiB read from the file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gguf import GGUFValueType as V

from gguf_tools.reader import read_header
from gguf_tools.skeleton import write_skeleton

N_VOCAB, N_MERGES = 151_936, 151_387

_CHILD = r"""
import json, os, sys, time
def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar")).split()[1])
def mapped_rss(path):
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total
path, which = sys.argv[1], sys.argv[2]
if which == "ours":
    from gguf_tools.reader import read_header
    from gguf_tools.inspect import account
    r0 = rchar(); t = time.perf_counter()
    h = read_header(path); account(h)
    dt = time.perf_counter() - t
    print(json.dumps({"s": dt, "rchar": rchar() - r0, "reported": h.bytes_read}))
else:
    import gguf
    r0 = rchar(); t = time.perf_counter()
    r = gguf.GGUFReader(path)
    n = len(r.tensors)
    dt = time.perf_counter() - t
    print(json.dumps({"s": dt, "rchar": rchar() - r0, "mapped": mapped_rss(os.path.realpath(path))}))
"""


def _vocab() -> dict:
    """A tokenizer of Qwen3's size whose strings average the length of real BPE pieces."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = [f"Ġ{letters[i % 26]}{letters[(i // 26) % 26]}{i % 997:x}" for i in range(N_VOCAB)]
    merges = [f"{tokens[i]} {tokens[i + 1][1:]}" for i in range(N_MERGES)]
    return {
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.token_type": ([1] * N_VOCAB, V.ARRAY),
        "tokenizer.ggml.merges": (merges, V.ARRAY),
    }


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def _time_cmd(argv: list[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return times


def _child(path: Path, which: str, repeat: int) -> dict:
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD, str(path), which], check=True,
                                      capture_output=True, text=True).stdout) for _ in range(repeat)]
    out = dict(runs[-1])
    out["s"] = statistics.median(r["s"] for r in runs)
    return out


def measure(path: Path, repeat: int) -> dict:
    """Our command and parse `repeat` times (median); GGUFReader once (it is slow on big vocabularies)."""
    localinfer = [sys.executable, "-m", "localinfer", "inspect", str(path)]
    reader = [sys.executable, "-c", "import gguf, sys; gguf.GGUFReader(sys.argv[1])", str(path)]
    python = [sys.executable, "-c", "pass"]
    cmd_ours, cmd_python = _time_cmd(localinfer, repeat), _time_cmd(python, repeat)
    cmd_gguf = _time_cmd(reader, 1)
    ours, theirs = _child(path, "ours", repeat), _child(path, "gguf", 1)
    return {
        "file": path.name, "file_size": path.stat().st_size, "disk_used": path.stat().st_blocks * 512,
        "header_bytes": read_header(path).data_offset,
        "command_s": statistics.median(cmd_ours), "command_min_s": min(cmd_ours),
        "gguf_command_s": cmd_gguf[0], "python_startup_s": statistics.median(cmd_python),
        "parse_s": ours["s"], "gguf_parse_s": theirs["s"], "parse_ratio": theirs["s"] / ours["s"],
        "bytes_read": ours["reported"], "rchar": ours["rchar"],
        "gguf_rchar": theirs["rchar"], "gguf_mapped_rss": theirs["mapped"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--dir", help="where to write the sparse skeletons (default: a temp dir)")
    args = ap.parse_args()
    load0 = _loadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        small = write_skeleton("qwen3-235b-a22b", Path(tmp) / "qwen3-235b-q2_k.gguf")
        real = write_skeleton("qwen3-235b-a22b", Path(tmp) / "qwen3-235b-q2_k-vocab.gguf", extra_kv=_vocab())
        rows = {"skeleton header": measure(small, args.repeat), "with 152K vocabulary": measure(real, args.repeat)}
    print(f"machine: {os.cpu_count()} CPUs, load average {_loadavg()} (before: {load0}); "
          f"median of {args.repeat} runs (GGUFReader: 1)\n")
    head = (f"{'file':<22}{'size':>10}{'header':>10}{'command':>10}{'python':>9}{'parse':>9}{'GGUFReader':>12}"
            f"{'ratio':>7}{'read (ours)':>13}{'GGUFReader touched':>20}{'GGUFReader cmd':>16}")
    print(head)
    for name, r in rows.items():
        print(f"{name:<22}{r['file_size'] / 2**30:>7.2f}GiB{r['header_bytes'] / 2**20:>7.2f}MiB"
              f"{r['command_s']:>9.3f}s{r['python_startup_s']:>8.3f}s"
              f"{r['parse_s'] * 1e3:>7.1f}ms{r['gguf_parse_s'] * 1e3:>10.1f}ms{r['parse_ratio']:>6.1f}x"
              f"{r['rchar'] / 2**20:>9.2f} MiB{r['gguf_mapped_rss'] / 2**20:>16.2f} MiB{r['gguf_command_s']:>15.3f}s")
    print("\ncommand: `python -m localinfer inspect FILE` wall time (target < 0.3 s); python: bare interpreter start;"
          "\nparse: header + accounting in-process; ratio: GGUFReader time / ours; read: read() bytes from the model"
          "\nfile during our parse (target < 10 MiB); GGUFReader touched: resident pages of its memory map of the file;"
          "\nGGUFReader cmd: `python -c 'import gguf; gguf.GGUFReader(FILE)'` wall time")
    if args.json:
        meta = {"cpus": os.cpu_count(), "loadavg_before": load0, "loadavg_after": _loadavg(),
                "repeat": args.repeat, "python": sys.version.split()[0]}
        Path(args.json).write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
