"""Planning a split offline: llama.cpp's split points, a split that fits, the fewest devices, link profiles,
the speed per stage, and `fit --devices` (no backend runtime imported)."""

import json
import subprocess
import sys

import pytest

from localinfer.backends.llamacpp.split import HOST, fitting_split, smallest_set, split_breakdown, unit_devices
from localinfer.backends.memory import FitRequest
from localinfer.backends.split import SplitDevice
from localinfer.devices.links import builtin_links, get_link
from localinfer.errors import UsageError
from localinfer.model.sources import resolve_model
from localinfer.model.spec import ModelSpec
from localinfer.plan.split import fit_split, parse_shares, split_speed
from localinfer.plan.split_devices import from_profiles, parse_hosts
from localinfer.units import MiB
from tests.support.rpc_workers import ROOT


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_gguf(str(resolve_model(None)))


def _counts(units, n_dev):
    return [sum(1 for u in units if u == i) for i in range(n_dev)]


def test_split_points_as_llamacpp():
    assert _counts(unit_devices(30, -1, [1, 1]), 2) == [16, 15]          # 31 units: layers + output
    assert _counts(unit_devices(30, -1, [1, 2]), 2) == [11, 20]          # 10/31 < 1/3 <= 11/31
    assert _counts(unit_devices(30, -1, [1, 3]), 2) == [8, 23]
    u = unit_devices(30, 20, [1, 1])                                    # -ngl 20 counts the output layer
    assert u[:11] == (HOST,) * 11 and _counts(u, 2) == [10, 10] and u[30] == 1
    assert unit_devices(30, 0, [1, 1]) == (HOST,) * 31
    assert _counts(unit_devices(30, -1, [7, 0, 1]), 3)[1] == 0          # a zero share gets nothing
    with pytest.raises(UsageError, match="all be zero"):
        unit_devices(30, -1, [0, 0])


def test_shares_parse():
    assert parse_shares("3,1") == (3.0, 1.0)
    for bad in ("x", "1,-1", "0,0", "inf"):
        with pytest.raises(UsageError, match="--tensor-split"):
            parse_shares(bad)


def _devs(*usable_mib):
    return [SplitDevice(f"RPC0[h{i}:1]", "cpu", 8 << 30, u * MiB) for i, u in enumerate(usable_mib)]


def test_a_split_that_fits_when_the_default_does_not(spec):
    req = FitRequest(n_ctx=512)
    devs = _devs(260, 150)      # the device holding the output needs ~130 MiB: logits rows in its compute buffer
    asked = split_breakdown(spec, devs, req)
    assert not asked.fits and asked.devices[0].fits and not asked.devices[1].fits
    fix = fitting_split(spec, devs, req)
    assert fix is not None and fix.fits
    again = split_breakdown(spec, devs, req, fix.counts())      # the printed --tensor-split reproduces it
    assert again.counts() == fix.counts() and again.fits
    assert fitting_split(spec, _devs(120, 120), req) is None


def test_smallest_set(spec):
    req = FitRequest(n_ctx=512)
    chosen, sb = smallest_set(spec, _devs(100, 400, 100), req)
    assert chosen == (1,) and sb.fits
    chosen, sb = smallest_set(spec, _devs(150, 150, 150), req)
    assert len(chosen) == 2 and sb.fits
    assert smallest_set(spec, _devs(100, 100, 100), req) is None


def test_links_cite_their_sources():
    links = builtin_links()
    assert {"loopback", "1gbe", "10gbe", "thunderbolt"} <= set(links)
    for link in links.values():
        assert link.bandwidth > 0 and link.rtt_s > 0
        assert link.sources.get("bandwidth") and link.sources.get("rtt")
    with pytest.raises(UsageError, match="--link"):
        get_link("carrier-pigeon")


def test_speed_pays_the_network_per_token(spec):
    setup = from_profiles("m2-max-96gb,m2-max-96gb")
    req = FitRequest(n_ctx=4096)
    sb = split_breakdown(spec, setup.devices, req)
    slow = split_speed(spec, sb, req, setup.profiles, get_link("1gbe"), setup.remote)
    fast = split_speed(spec, sb, req, setup.profiles, get_link("thunderbolt"), setup.remote)
    none = split_speed(spec, sb, req, setup.profiles, None, setup.remote)
    assert slow.round_trips == 1 and slow.token_bytes < spec.vocab_size * 4     # the last stage is local
    both = split_speed(spec, sb, req, setup.profiles, get_link("1gbe"), [True, True])
    assert both.round_trips == 2 and both.token_bytes > spec.vocab_size * 4     # the logits come back
    assert none.decode_tok_s > fast.decode_tok_s > slow.decode_tok_s
    assert slow.upload_s == pytest.approx(sb.devices[0].weights / get_link("1gbe").bandwidth)
    assert [s.layers for s in slow.stages] == [len(d.layers) for d in sb.devices]


def test_hosts_parse():
    assert parse_hosts("m2-max-96gb, 2x rtx-4090") == [(1, "m2-max-96gb"), (2, "rtx-4090")]
    setup = from_profiles("2x rtx-4090")
    assert [d.name for d in setup.devices] == ["CUDA0[rtx-4090]", "CUDA1[rtx-4090]"] and not any(setup.remote)
    with pytest.raises(UsageError, match="no device"):
        from_profiles("local")


def test_fit_split_verdict_and_json(spec):
    setup = from_profiles("m2-max-96gb,m2-max-96gb")
    sf = fit_split(spec, setup.devices, FitRequest(n_ctx=2048), host_usable=setup.host_usable,
                   profiles=setup.profiles, link=get_link("thunderbolt"), remote=setup.remote)
    assert sf.fits and sf.smallest[0] == (1,)          # the local Mac alone: no network
    doc = json.loads(json.dumps(sf.to_dict()))
    assert doc["split"]["counts"] == [16, 15] and doc["speed"]["link"] == "thunderbolt"


def test_fit_devices_cli_imports_no_backend():
    code = ("import sys; from localinfer.cli import main; rc = main(['fit', '--devices', 'rtx-4090,rtx-4090', "
            "'--link', '1gbe', '-c', '1024']); print('LOADED', [m for m in ('llama_cpp', 'torch', 'mlx') "
            "if m in sys.modules]); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, check=False)
    assert r.returncode == 0, r.stderr
    assert "LOADED []" in r.stdout
    assert "RPC0[host1:rtx-4090]" in r.stdout and "CUDA0[rtx-4090]" in r.stdout and "network per token" in r.stdout


def test_report_split_rows(capsys):
    from localinfer.cli import main

    assert main(["report", "--devices", "rtx-4090", "--split", "rtx-4090,rtx-4090", "--link", "10gbe",
                 "--ctx", "1024,4096", "--kv", "f16,q8_0", "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "## Split over rtx-4090,rtx-4090 (10gbe)" in out
    assert sum(1 for line in out.splitlines() if line.startswith("| Smollm2")) == 4
    assert main(["report", "--devices", "rtx-4090", "--split", "rtx-4090", "--format", "json", "--ctx", "1024",
                 "--kv", "f16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["splits"]["rows"][0]["split"]["devices"][0]["name"] == "CUDA0[rtx-4090]"
    assert main(["report", "--split", "rtx-4090", "--format", "html"]) == 2


def test_plan_split_is_slower_per_step_than_one_device_and_pays_the_link(capsys):
    from localinfer.cli import main

    common = ["plan", "--requests", "2", "--input", "1024", "--output", "64", "--json"]
    assert main([*common, "--device", "rtx-4090"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*common, "--split", "rtx-4090,rtx-4090", "--link", "1gbe"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["device"] == "rtx-4090,rtx-4090"

    def step(doc, kv="f16"):
        return next(o for o in doc["outcomes"] if o["kv"] == kv and not o["drafting"])["step_s"]

    assert step(split) > step(one)            # the same work in turn, plus the network
    assert main(["plan", "--split", "local,local"]) == 2   # this CPU as a worker: no profile speed
    assert "no bandwidth" in capsys.readouterr().err
