"""`plan --split` over a placement that keeps experts in host RAM (issue 41): the host is a stage of the planner's
step (plan/host_speed.py HostWork), a batch's tokens read the union of the experts they route to, from 32 tokens a
call the host weights cross the GPU's link instead, and the placement is fit --devices' for the workload's
requests.  Header-only skeletons, offline profiles."""

import math
import subprocess
import sys

import pytest

from gguf_tools.skeleton import write_skeleton
from localinfer.cli import main
from localinfer.devices.hosts import get_host
from localinfer.generation.load import open_model
from localinfer.plan.host_speed import OFFLOAD_MIN_BATCH, HostWork, host_terms


def _step_s(outcome: dict) -> float:
    return outcome["step_s"]


def test_plan_split_plans_on_experts_in_ram_and_agrees_with_fit_at_one_request(moe, capsys, cli_json):
    fit = cli_json("fit", moe, "--devices", "rtx-3090", "--ctx", "4096")["plan"]
    assert fit["experts_on_host"] > 0
    doc = cli_json("plan", moe, "--split", "rtx-3090", "--input", "3840", "--output", "256")
    place = doc["split_placement"]
    assert place["planned_on"] is True and place["plan"]["flags"] == fit["flags"]
    best = next(o for o in doc["outcomes"] if o["name"] == doc["best"])
    assert best["verdict"] == "fits"
    # one request's decode step: the planner's stages (kernel model for the GPU, the host's RAM and cores) against
    # fit's split speed for the same placement, two models of one step
    fit_step = 1.0 / fit["speed"]["decode_tok_s"]
    assert _step_s(best) == pytest.approx(fit_step, rel=0.1)
    assert main(["plan", moe, "--split", "rtx-3090", "--input", "3840", "--output", "256"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "planned on it: the weights it keeps in host RAM are timed on ddr5-5600-2ch" in text


def test_more_requests_put_more_experts_in_ram_and_a_step_of_32_copies_them(moe, cli_json):
    got = {}
    for n in (1, 16, 31, 32):
        doc = cli_json("plan", moe, "--split", "rtx-3090", "--input", "512", "--output", "128",
                    "--requests", str(n))
        plan = doc["split_placement"]["plan"]
        assert plan["fits"] and plan["n_seq"] == n
        best = next(o for o in doc["outcomes"] if o["name"] == doc["best"])
        assert best["verdict"] == "fits"
        got[n] = (plan["experts_on_host"] + (plan["touched_on_host"] - plan["experts_on_host"]) / 2, _step_s(best))
    assert got[1][0] < got[16][0] < got[31][0]             # room for more requests' KV: experts move to RAM
    assert got[1][1] < got[16][1] < got[31][1]             # more tokens a step: more experts read, more FLOPs
    assert got[16][1] < 16 * got[1][1]                     # ... but the shared part of a step is read once
    # 32 tokens a step: llama.cpp's CUDA backend copies the host weights over the link and computes there
    assert got[32][1] > got[31][1]


def test_host_work_reads_the_union_of_experts_and_offloads_from_32_tokens(moe):
    spec = open_model(moe).spec
    names = frozenset(t.name for t in spec.tensors if "_exps." in t.name and int(t.name.split(".")[1]) < 12)
    host = get_host("ddr5-5600-2ch")
    read, flops, held, _ = host_terms(spec, names)
    link = 32e9
    local = HostWork(spec, names, host, link_bytes_per_s=link)
    assert local.read_bytes(1) == pytest.approx(read, rel=1e-9)
    k_over_n = spec.n_expert_used / spec.n_expert
    assert local.read_bytes(4) == pytest.approx(held * (1 - (1 - k_over_n) ** 4), rel=1e-6)
    assert read < local.read_bytes(8) < held and local.read_bytes(10_000) == pytest.approx(held, rel=1e-6)
    s, mem, comp = local.decode(1)
    assert s == max(mem, comp) and mem == pytest.approx(read / host.effective_bandwidth)
    assert comp == pytest.approx(flops / host.decode_flops)
    # offloaded, the scheduler copies only the experts the call's tokens use
    assert local.decode(OFFLOAD_MIN_BATCH)[0] == pytest.approx(local.weight_bytes(OFFLOAD_MIN_BATCH) / link)
    assert local.weight_bytes(OFFLOAD_MIN_BATCH) < held
    assert local.prefill(1000, 512) == pytest.approx(2 * local.weight_bytes(512) / link)
    assert local.prefill(20, 512) == pytest.approx(20 * flops / host.decode_flops)    # a 20-token call stays home
    # no local GPU (RPC devices only): the host computes every batch, and a prefill's share at its batched rate
    remote = HostWork(spec, names, host)
    s32, mem32, comp32 = remote.decode(OFFLOAD_MIN_BATCH)
    # one rate for one shape: 32 tokens a call at the batched rate, in a decode step as in a prefill's call
    assert s32 == max(mem32, comp32) and comp32 == pytest.approx(32 * flops / remote.rate(32))
    assert remote.rate(32) == max(host.decode_flops, host.effective_flops) and remote.rate(1) == host.decode_flops
    assert remote.prefill(1000, 512) == pytest.approx(1000 * flops / remote.rate(512))
    assert not math.isnan(remote.prefill(1000, 512))


def test_a_device_without_a_host_profile_keeps_the_old_refusal(moe, tmp_path):
    prof = tmp_path / "nohost.toml"
    prof.write_text('name = "nohost-24g"\nkind = "cuda"\nmemory = "24GiB"\nbandwidth = "936GB/s"\n'
                    'bf16_flops = 71e12\nlink = { name = "PCIe", per_direction = "32GB/s" }\n')
    env = {"LOCALINFER_PROFILES": str(prof), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "localinfer", "plan", moe, "--split", "nohost-24g", "--input", "3840",
           "--output", "256"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    assert "cannot hold this model" in done.stderr and "no host profile times them" in done.stderr
    assert "--n-cpu-moe" in done.stderr and "predicted" in done.stderr     # the placement fit --devices would use
    assert "Traceback" not in done.stderr


def test_a_host_without_cores_says_why_the_split_has_no_speed(moe, capsys, cli_json):
    """A unified-memory first host (bandwidth, no CPU cores or FLOP/s) holds the experts: the plan fits with its
    decode timed from the RAM, and the missing prompt speed is said to come from the host's profile, not from a
    `bench --json` that a --split does not take (in the text and in --json)."""
    argv = ["plan", moe, "--split", "ryzen-ai-max-395,rtx-3090", "--input", "512", "--output", "128"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "keeps weights in the RAM of ryzen-ai-max-395" in out and "no CPU cores or FLOP/s" in out
    assert "bench --json FILE" not in out and "measure this device" not in out
    assert "ryzen-ai-max-395's RAM (its profile gives no CPU cores" in out
    doc = cli_json(*argv)
    assert doc["best"] is None and "ryzen-ai-max-395" in doc["speed_unknown"]
    assert all(o["verdict"] == "fits, speed unknown" for o in doc["outcomes"])
    assert all(0 < o["step_s"] < 1 for o in doc["outcomes"])            # decode timed from the host's RAM
    assert all("bench --json" not in why for why in doc["reasons"].values())
    assert main(["plan", moe, "--split", "rtx-3090", "--input", "512", "--output", "128"]) == 0
    out = capsys.readouterr().out        # a host with cores: timed, no such line
    assert "speed unknown" not in out and "RAM and cores" in out
    assert "speed_unknown" not in cli_json("plan", moe, "--split", "rtx-3090", "--input", "512", "--output", "128")


def test_host_layers_keep_their_kv_and_attention_on_the_host(tmp_path):
    """A dense model with layers below -ngl: the host holds whole layers (weights read whole at any batch) and their
    KV, which stays on the host even where a 32-token call copies the weights to the GPU."""
    spec = open_model(str(write_skeleton("llama-3.1-8b", tmp_path / "l.gguf", type="q4_k_m"))).spec
    names = frozenset(t.name for t in spec.tensors if t.name.startswith("blk.") and int(t.name.split(".")[1]) < 8)
    host = get_host("ddr5-5600-2ch")
    work = HostWork(spec, names, host, kv_per_token=1000.0, link_bytes_per_s=32e9)
    assert work.expert == 0 and work.other == work.held and work.layers == 8
    assert work.weight_bytes(1) == work.weight_bytes(64) == work.held             # dense: all read at any batch
    kv_s = 1000.0 * 50_000 / host.effective_bandwidth
    s1, mem1, comp1 = work.decode(1, 50_000)
    assert mem1 == pytest.approx((work.held + 50_000 * 1000.0) / host.effective_bandwidth)
    s64, mem64, _ = work.decode(64, 50_000)
    assert s64 == pytest.approx(work.held / 32e9 + kv_s) and mem64 == s64


def test_plan_split_times_a_dense_model_with_layers_in_ram(tmp_path, cli_json):
    path = str(write_skeleton("llama-3.1-70b", tmp_path / "l70.gguf", type="q4_k_m"))
    steps = {}
    for n in (1, 8, 64):
        doc = cli_json("plan", path, "--split", "rtx-4090", "--input", "1024", "--output", "256",
                    "--requests", str(n))
        place = doc["split_placement"]
        assert place["planned_on"] is True and place["host"] == "ddr5-5600-2ch"
        best = next(o for o in doc["outcomes"] if o["name"] == doc["best"])
        steps[n] = best["step_s"]
    # 8 tokens a step: the host computes 8 tokens of its layers; 64: their weights cross the link once (offload_op),
    # which can be the cheaper of the two, so no order between 8 and 64 is asserted
    assert steps[1] < steps[8] and steps[1] < steps[64]
