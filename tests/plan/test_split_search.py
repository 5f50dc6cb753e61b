"""The search over several devices (plan/split_fit.py) tries what the one-device search tries (plan/moe_fit.py):
q8_0 KV for an f16 request and, for `--objective ttft`, larger -ub; `plan --split` and `report --split` show the
plan `fit --devices` recommends, with its speed (issue 41: fit, plan and report print the speed of the plan they
recommend).  Header-only skeletons, offline profiles."""

import json
import re

from gguf_tools.skeleton import write_skeleton
from localinfer.cli import main

# Qwen3-30B-A3B Q8_0 (32 GB), 4 × 40,960 tokens on two RTX 3090: an f16 cache (15 GiB) leaves part of a layer's
# experts in RAM, a q8_0 one (8 GiB) none: predicted 104 against 76 tok/s
HOSTS, CTX, NP = "2x rtx-3090", "40960", "4"


def _obeys_the_rule(doc, objective="decode"):
    plan, ref = doc["plan"], doc["llamacpp_fit"]
    assert plan is not None and plan["fits"] and plan["split"]["fits"] and plan["host_total"] <= plan["host_usable"]
    if ref is not None and ref["fits"]:
        if objective == "decode":
            assert plan["speed"]["decode_tok_s"] >= ref["speed"]["decode_tok_s"]
        else:
            assert plan["speed"]["prefill_tok_s"] >= ref["speed"]["prefill_tok_s"]


def test_q8_0_kv_keeps_more_experts_on_two_devices_and_says_both_speeds(moe, capsys, cli_json):
    doc = cli_json("fit", moe, "--devices", HOSTS, "--ctx", CTX, "-np", NP)
    _obeys_the_rule(doc)
    plan = doc["plan"]
    assert plan["type_k"] == plan["type_v"] == "q8_0" and "-ctk q8_0 -ctv q8_0 -fa on" in plan["flags"]
    asked = [a for a in plan["alternatives"] if a["type_k"] == "f16"]
    best_asked = max(asked, key=lambda a: a["speed"]["decode_tok_s"])
    assert plan["speed"]["decode_tok_s"] > 1.03 * best_asked["speed"]["decode_tok_s"]
    assert best_asked["touched_on_host"] > plan["touched_on_host"]
    more = best_asked["touched_on_host"] - plan["touched_on_host"]
    assert (f"KV q8_0 (each token reads 0.53x the KV bytes) keeps {more} more layers' experts on the devices: "
            "against ") in plan["why"]
    for p in (plan, best_asked):
        assert f"{p['speed']['decode_tok_s']:.1f} tok/s, TTFT " in plan["why"]
    assert main(["fit", moe, "--devices", HOSTS, "--ctx", CTX, "-np", NP]) == 0
    out = capsys.readouterr().out
    assert f"localinfer's plan: {plan['flags']}\n" in out
    assert f"decode {plan['speed']['decode_tok_s']:.1f} tok/s" in out and "as asked" in out


def test_a_quantized_kv_request_is_not_changed(moe, cli_json):
    doc = cli_json("fit", moe, "--devices", HOSTS, "--ctx", CTX, "-np", NP, "--kv-type", "q8_0")
    _obeys_the_rule(doc)
    assert all(a["type_k"] == "q8_0" for a in [doc["plan"], *doc["plan"]["alternatives"]])


def test_the_ttft_objective_over_two_devices(moe, cli_json):
    dec = cli_json("fit", moe, "--devices", HOSTS, "--ctx", CTX, "-np", NP)["plan"]
    doc = cli_json("fit", moe, "--devices", HOSTS, "--ctx", CTX, "-np", NP, "--objective", "ttft")
    _obeys_the_rule(doc, "ttft")
    ttft = doc["plan"]
    assert ttft["speed"]["prefill_tok_s"] >= dec["speed"]["prefill_tok_s"]
    assert "best predicted TTFT" in ttft["why"]


def test_ttft_takes_a_larger_ub_where_host_experts_cross_the_link_per_ubatch(tmp_path, cli_json):
    """Qwen3-235B Q4_K_M on two RTX 3090, no mmap: each -ub copies the host experts to the GPU once, so -ub 2048
    makes 8 copies of a 16k prompt, not 32."""
    path = str(write_skeleton("qwen3-235b-a22b", tmp_path / "q235.gguf", type="q4_k_m"))
    doc = cli_json("fit", path, "--devices", HOSTS, "--ctx", "16384", "--no-mmap", "--objective", "ttft")
    _obeys_the_rule(doc, "ttft")
    plan, ref = doc["plan"], doc["llamacpp_fit"]
    assert plan["n_ubatch"] > 512 and f"-ub {plan['n_ubatch']}" in plan["flags"]
    assert plan["speed"]["prefill_tok_s"] > 1.5 * ref["speed"]["prefill_tok_s"]
    assert "host experts copied over the link" in plan["why"] and "best predicted TTFT" in plan["why"]


def test_report_split_rows_show_fits_plan_and_speed(moe, capsys, cli_json):
    doc = cli_json("fit", moe, "--devices", HOSTS, "--ctx", CTX, "--kv-type", "q8_0", "-fa", "on")
    assert main(["report", moe, "--devices", "rtx-3090", "--split", HOSTS, "--ctx", CTX, "--kv", "f16,q8_0",
                 "--format", "json"]) == 0
    rows = {r["kv"]: r for r in json.loads(capsys.readouterr().out)["splits"]["rows"]}
    row = rows["q8_0"]
    assert row["plan"]["flags"] == doc["plan"]["flags"]
    assert row["plan"]["speed"]["decode_tok_s"] == doc["plan"]["speed"]["decode_tok_s"]
    assert (row["llamacpp_fit"] or {}).get("flags") == (doc["llamacpp_fit"] or {}).get("flags")
    assert rows["f16"]["plan"]["type_k"] == "f16"            # a row keeps its KV type
    assert main(["report", moe, "--devices", "rtx-3090", "--split", HOSTS, "--ctx", CTX, "--kv", "q8_0",
                 "--format", "md"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| Qwen3-30B-A3B"))
    assert f"| {doc['plan']['summary']} | {doc['plan']['speed']['decode_tok_s']:.1f} |" in line


def test_plan_split_shows_fits_plan_and_its_speed(moe, capsys, cli_json):
    doc = cli_json("fit", moe, "--devices", HOSTS, "--ctx", "4096")
    out = cli_json("plan", moe, "--split", HOSTS, "--input", "3840", "--output", "256")
    place = out["split_placement"]
    assert place["plan"]["flags"] == doc["plan"]["flags"]
    assert place["plan"]["speed"]["decode_tok_s"] == doc["plan"]["speed"]["decode_tok_s"]
    assert place["planned_on"] is True
    assert main(["plan", moe, "--split", HOSTS, "--input", "3840", "--output", "256"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"placement \(fit --devices' plan for one request\): .*: predicted \d+\.\d tok/s, TTFT ", text)
    assert "llama.cpp --fit: " in text

