"""`localinfer serve` reports each device's memory as llama.cpp allocated it, beside fit's prediction, in
/metrics (``localinfer_device_memory_bytes{device, kind, source}``) and /v1/engine/state (``devices``): the
embedded model over two loopback RPC workers (1 thread each), and on this machine's CPU alone (one row).

llama.cpp logs its buffers in MiB with two decimals, so that is the resolution at which the two must agree:
the prediction printed as llama.cpp prints it equals what it printed."""

import pytest

from tests.serve.test_http_support import start_cli
from tests.support.rpc_workers import workers

pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families

MIB = 1 << 20


def _served_devices(*flags) -> tuple[dict, list[dict]]:
    """(/metrics' device samples {(device, kind, source): bytes}, /v1/engine/state's devices) of a fresh server."""
    p, url = start_cli("-t", "1", "--ctx", "512", *flags)
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
        rows = httpx.get(url + "/v1/engine/state", timeout=30).json()["devices"]
    finally:
        p.terminate()
        assert p.wait(30) == 0
    samples = {(s.labels["device"], s.labels["kind"], s.labels["source"]): s.value
               for family in text_string_to_metric_families(text) if family.name == "localinfer_device_memory_bytes"
               for s in family.samples}
    return samples, rows


def _check(samples: dict, rows: list[dict], devices: list[str]) -> None:
    assert [r["device"] for r in rows] == devices
    for r in rows:
        for kind in ("weights", "kv", "state", "compute"):
            predicted, reported = r["predicted"][kind], r["reported"][kind]
            assert f"{predicted / MIB:.2f}" == f"{reported / MIB:.2f}", (r["device"], kind, predicted, reported)
            assert samples[(r["device"], kind, "predicted")] == predicted
            assert samples[(r["device"], kind, "reported")] == reported
    assert len(samples) == 8 * len(rows)          # 4 kinds (the recurrent state among them) × predicted/reported


def test_metrics_per_device_over_two_workers():
    with workers(2) as ws:
        eps = [ep for _, ep in ws]
        samples, rows = _served_devices("--rpc", ",".join(eps))
    _check(samples, rows, [f"RPC0[{ep}]" for ep in eps] + ["CPU"])
    first, last, host = rows
    assert first["layers"] == list(range(16)) and not first["output"]       # equal free memory: 16 + 15 units
    assert last["layers"] == list(range(16, 30)) and last["output"]
    assert host["predicted"]["kv"] == 0 and host["predicted"]["weights"] > 0    # the input layer stays here
    assert all(r["reported"]["weights"] > 0 and r["reported"]["kv"] > 0 for r in (first, last))


def test_metrics_on_this_machines_cpu_alone():
    samples, rows = _served_devices()
    _check(samples, rows, ["CPU"])
    assert all(rows[0]["reported"][k] > 0 for k in ("weights", "kv", "compute"))
