"""Every number `fit`, `plan`, `report` and `inspect` print in --json is still printed, at the same key, with
the same value, as before the layout change (recorded in tests/data/cli_baseline by running this file).

New keys may appear; none may go missing or change.  Skeleton paths print as ``<name>``.
Record again (only on purpose): ``python -m tests.cli.test_outputs_unchanged``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BASELINE = Path(__file__).resolve().parents[1] / "data" / "cli_baseline"
DEVICES = ["rtx-pro-6000", "m2-max-96gb", "h200", "rtx-4090", "a100-80gb-pcie"]
SKELETONS = {"qwen3-8b": "q4_k_m", "qwen3-235b-a22b": "q4_k_m", "llama-3.1-8b": "q8_0"}
VOLATILE = {"created"}


def cases(sk: dict[str, str]) -> dict[str, list[str]]:
    q8, moe, ll = sk["qwen3-8b"], sk["qwen3-235b-a22b"], sk["llama-3.1-8b"]
    on = ["--json", "--device", *DEVICES]
    return {
        "fit_default": ["fit", *on],
        "fit_default_ctx8k_np4": ["fit", "--ctx", "8192", "--parallel", "4", *on],
        "fit_default_torch": ["fit", "--backend", "torch", *on],
        "fit_default_mlx": ["fit", "--backend", "mlx", *on],
        "fit_qwen3_8b": ["fit", q8, "--ctx", "32768", *on],
        "fit_qwen3_8b_q8kv": ["fit", q8, "--ctx", "32768", "-ctk", "q8_0", "-ctv", "q8_0", *on],
        "fit_qwen3_8b_ngl20_np8": ["fit", q8, "--ctx", "16384", "--parallel", "8", "-ngl", "20", *on],
        "fit_qwen3_8b_torch_bf16": ["fit", q8, "--backend", "torch", "--dtype", "bf16", *on],
        "fit_qwen3_8b_mlx": ["fit", q8, "--backend", "mlx", "--ctx", "16384", *on],
        "fit_moe": ["fit", moe, "--ctx", "8192", *on],
        "fit_llama_fa_off_ub256": ["fit", ll, "--ctx", "131072", "-fa", "off", "-ub", "256", *on],
        "inspect_default": ["inspect", "--json"],
        "inspect_qwen3_8b_tensors": ["inspect", q8, "--tensors", "--json"],
        "inspect_moe": ["inspect", moe, "--json"],
        "plan_qwen3_8b": ["plan", q8, "--device", "rtx-pro-6000", "--requests", "16", "--input", "8192", "--output",
                          "256", "--shared-prefix", "6144", "--deadline", "7", "--kv-budget", "12GiB",
                          "--acceptance", "0.5", "--json"],
        "plan_qwen3_8b_h200": ["plan", q8, "--device", "h200", "--requests", "64", "--input", "2048", "--output",
                               "512", "--deadline", "30", "--json"],
        "plan_moe_h200": ["plan", moe, "--device", "h200", "--requests", "4", "--input", "4096", "--output", "128",
                          "--deadline", "120", "--json"],
        "plan_default_m2": ["plan", "--device", "m2-max-96gb", "--requests", "8", "--input", "1024", "--output",
                            "256", "--deadline", "10", "--acceptance", "0.6", "--json"],
        "report": ["report", q8, moe, "--devices", ",".join(DEVICES), "--ctx", "2048,8192,32768",
                   "--kv", "f16,q8_0,q4_0", "--format", "json"],
        "report_default": ["report", "--devices", "rtx-pro-6000,m2-max-96gb", "--format", "json"],
    }


def skeletons(root: Path) -> dict[str, str]:
    out = {}
    for name, qtype in SKELETONS.items():
        path = root / f"{name}.gguf"
        subprocess.run([sys.executable, "-m", "localinfer", "skeleton", name, "--type", qtype, "-o", str(path)],
                       check=True, capture_output=True)
        out[name] = str(path)
    return out


def run_case(argv: list[str], sk: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-m", "localinfer", *argv], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for name, path in sk.items():
        text = text.replace(path, f"<{name}>")
    return text


def missing_or_changed(old, new, where="$") -> list[str]:
    """Paths in ``old`` that ``new`` lacks or holds with another value (new keys are allowed)."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{where}: was an object"]
        out = []
        for k, v in old.items():
            if k in VOLATILE:
                continue
            if k not in new:
                out.append(f"{where}.{k}: missing")
            else:
                out += missing_or_changed(v, new[k], f"{where}.{k}")
        return out
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{where}: list length {len(old)} -> {len(new) if isinstance(new, list) else type(new).__name__}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in missing_or_changed(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


@pytest.fixture(scope="module")
def skeleton_paths(tmp_path_factory):
    return skeletons(tmp_path_factory.mktemp("skeletons"))


@pytest.mark.parametrize("case", sorted(cases({k: k for k in SKELETONS})))
def test_json_output_is_unchanged(case, skeleton_paths):
    old = json.loads((BASELINE / f"{case}.json").read_text())
    new = json.loads(run_case(cases(skeleton_paths)[case], skeleton_paths))
    diffs = missing_or_changed(old, new)
    assert not diffs, f"{len(diffs)} differences, first: {diffs[:5]}"


def test_the_comparison_catches_a_changed_or_missing_number():
    old = {"a": {"b": [1, 2]}, "c": 3, "created": "x"}
    assert missing_or_changed(old, {"a": {"b": [1, 2]}, "c": 3, "d": 4}) == []
    assert missing_or_changed(old, {"a": {"b": [1, 5]}, "c": 3}) == ["$.a.b[1]: 2 -> 5"]
    assert missing_or_changed(old, {"a": {"b": [1, 2]}}) == ["$.c: missing"]


if __name__ == "__main__":
    import tempfile

    sk = skeletons(Path(tempfile.mkdtemp()))
    BASELINE.mkdir(parents=True, exist_ok=True)
    for key, argv in cases(sk).items():
        (BASELINE / f"{key}.json").write_text(run_case(argv, sk))
        print("recorded", key)
