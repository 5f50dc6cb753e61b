#!/usr/bin/env python3
"""Run llama.cpp's own server test suite (tools/server/tests) against `localinfer serve`, and count the results.

    python3 scripts/llama_server_suite.py [--files test_basic.py,test_completion.py,...] [--per-test-s 180]
        [--out benchmarks/results/llama_server_suite.txt]

The suite starts `llama-server` with its flags for every test; here a shim takes its place: it translates the
flags `localinfer serve` has (port, host, --ctx-size, --parallel, --alias, --api-key, --n-predict, -ctk/-ctv,
--batch-size, --chat-template-file, --cors-origins) and drops the rest.  The suite downloads its models from a
hub, which this machine cannot reach, so every test runs on the embedded SmolLM2-135M: assertions on the text
the suite's own tiny models write fail here by design.  Each failure is put in a class:

* ``llama-server only`` — an endpoint or feature only llama-server has (its /tokenize, /infill, /slots,
  /props, reranking, LoRA, the router, built-in template names, tools, multimodal, Anthropic's API...);
* ``model-specific text`` — the test expects the exact text or token counts of the suite's model;
* ``ours`` — everything else, to be read one by one.

The sources come from the llama-cpp-python sdist matching the installed version (scripts/llama_sources.sh).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("test_basic.py", "test_completion.py", "test_chat_completion.py", "test_embedding.py",
                 "test_compat_oai_responses.py", "test_security.py", "test_metrics.py", "test_ignore_eos.py",
                 "test_stream.py", "test_ctx_shift.py", "test_tokenize.py", "test_template.py")
# whole files about what only llama-server has
ONLY_FILES = {"test_tokenize.py", "test_infill.py", "test_rerank.py", "test_slot_save.py", "test_lora.py",
              "test_router.py", "test_proxy.py", "test_mcp_servers.py", "test_tools_builtin.py", "test_sleep.py",
              "test_compat_anthropic.py", "test_compat_gcp.py", "test_vision_api.py", "test_speculative.py",
              "test_kv_keep_only_active.py", "test_tool_call.py", "test_template.py"}
ONLY_WORDS = ("/tokenize", "/detokenize", "/infill", "/slots", "/props", "/apply-template", "/rerank", "/lora",
              "n_probs", "completion_probabilities", "timings", "tokens_predicted", "tokens_evaluated",
              "id_slot", "chat_template", "tool_calls", "response_format", "json_schema", "grammar", "llamacpp:",
              "post_sampling_probs", "return_tokens", "\"/completion\"", "'/completion'", "n_cmpl", "reasoning",
              "is_processing", "truncated", "generation_settings", "system_fingerprint", "n_indent", "lora",
              "x-response-time", "t_max_predict_ms", "samplers", "/v1/messages", "image")
# tests read one by one: (class, why), by test function (any parameters)
KNOWN = {
    "test_load_split_model": ("llama-server only", "a split GGUF fetched from a hub"),
    "test_server_multiple_addresses": ("llama-server only", "several --host addresses"),
    "test_server_props": ("llama-server only", "/props"),
    "test_server_slots": ("llama-server only", "/slots"),
    "test_server_models": ("llama-server only", "its --alias renames the model; here --alias adds a name"),
    "test_server_model_aliases_and_tags": ("llama-server only", "--tags, aliases in /v1/models"),
    "test_no_ui": ("llama-server only", "its web UI at / (another branch adds a page)"),
    "test_access_static_assets_without_api_key": ("llama-server only", "its web UI's files at /"),
    "test_apply_chat_template": ("llama-server only", "/apply-template"),
    "test_chat_completions_token_count": ("llama-server only", "/chat/completions/input_tokens"),
    "test_context_size_exceeded": ("llama-server only", ("its error type exceed_context_size_error; OpenAI's "
                                                         "invalid_request_error / context_length_exceeded here")),
    "test_context_size_exceeded_stream": ("llama-server only", "as test_context_size_exceeded"),
    "test_return_progress": ("llama-server only", "return_progress events"),
    "test_verbose_debug": ("llama-server only", "the __verbose debug field"),
    "test_metrics_disabled": ("llama-server only", "/metrics only with --metrics; here always"),
    "test_correct_api_key_anthropic_header": ("llama-server only", "Anthropic's x-api-key header"),
    "test_cors_options": ("llama-server only", "CORS for any origin by default; refused here by design (issue 32)"),
    "test_cors_proxy_only_forwards_explicit_proxy_headers": ("llama-server only", "its CORS proxy"),
    "test_local_media_file": ("llama-server only", "multimodal media files"),
    "test_logprobs_stream": ("llama-server only", "first chunk's content null; OpenAI sends \"\" as here"),
    "test_chat_completion_with_openai_library": ("llama-server only", "system_fingerprint 'b<build>'"),
    "test_completion_with_openai_library": ("llama-server only", "system_fingerprint 'b<build>'"),
    "test_chat_template": ("llama-server only", "built-in template names (--chat-template NAME)"),
    "test_chat_template_assistant_prefill": ("llama-server only", "assistant prefill (continue the last message)"),
    "test_chat_template_continue_final_message_vllm_compat": ("llama-server only", "continue_final_message"),
    "test_completion_with_grammar": ("llama-server only", "grammar (structured output: another branch)"),
    "test_completion_with_json_schema": ("llama-server only", "json_schema (structured output: another branch)"),
    "test_completion_with_response_format": ("llama-server only", "response_format (another branch)"),
    "test_embedding_pooling_none": ("llama-server only", "per-token embeddings (--pooling none)"),
    "test_embedding_mixed_input": ("llama-server only", "prompts mixing ids and text, prompt objects"),
    "test_embedding_content_text_same_as_string": ("llama-server only", "prompt objects with content parts"),
    "test_embedding_error_prompt_too_long": ("llama-server only", "its message words ('too large')"),
    "test_stream_resume_and_stop_with_slashed_model_name": ("llama-server only", "the router's model loading"),
    "test_stream_resumes_after_reload_during_model_load": ("llama-server only", "the router's model loading"),
    "test_stream_stop_during_model_load": ("llama-server only", "the router's model loading"),
    "test_ctx_shift_enabled": ("llama-server only", "--context-shift"),
    "test_ctx_shift_disabled_short_prompt": ("llama-server only", "/completion, n_predict -1 with ctx shift"),
    "test_cancel_request": ("llama-server only", "/completion and its slot timings"),
    "test_chat_completion_stream": ("llama-server only", "first chunk's content null; OpenAI sends \"\" as here"),
    "test_correct_api_key": ("llama-server only", "its native /completions ('content'); here OpenAI's (issue 32)"),
    "test_cors_origins_localhost_rejects": ("llama-server only", ("a foreign origin's preflight is 200 without "
                                                                  "CORS headers there, 403 here (issue 32)")),
    "test_embedding_pooling_none_oai": ("llama-server only", "--pooling none (the shim drops --pooling)"),
    "test_metrics_prometheus_format": ("llama-server only", "its Process-Start-Time-Unix header"),
    "test_metrics_embedding_prompt_is_counted": ("llama-server only", "its Process-Start-Time-Unix header"),
    "test_responses_with_openai_library": ("model-specific text", "its model's text ('Suddenly')"),
    "test_cors_origins_defaults_to_localhost_with_tools_enabled": ("llama-server only", ("a foreign origin's "
                                                                   "preflight: 200 there, 403 here (issue 32)")),
    "test_responses_stream_with_llama_telemetry": ("llama-server only", "timings and prompt_progress events"),
    "test_chat_completion_cached_tokens": ("model-specific text", "its model's token counts"),
    "test_invalid_chat_completion_req": ("model-specific text", "SmolLM2's template takes two assistant turns"),
    "test_ctx_shift_disabled_stream": ("model-specific text", "SmolLM2 stops before 256 tokens"),
    "test_embedding_usage_single": ("model-specific text", "another tokenizer's counts"),
    "test_embedding_usage_multiple": ("model-specific text", "another tokenizer's counts"),
    "test_completion_stream_with_openai_library": ("model-specific text", "its model's text"),
    "test_completion_stream_with_openai_library_stops": ("model-specific text", "its model's text"),
}
MODEL_WORDS = ("match_regex", "Suddenly", "Looking", "tinyllama", "stories", "bert", "assert res.body[\"usage\"]",
               "prompt_tokens", "completion_tokens", "== n_predict", "predicted_n", "n_tokens", "embedding")

SHIM = r'''#!/usr/bin/env python3
import os, sys
VALUE = {"--port": "--port", "--host": "--host", "--ctx-size": "--ctx", "-c": "--ctx", "--parallel": "--parallel",
         "-np": "--parallel", "--alias": "--alias", "--api-key": "--api-key", "--n-predict": "--default-max-tokens",
         "-ctk": "-ctk", "-ctv": "-ctv", "--batch-size": "-b", "--ubatch-size": "-ub",
         "--chat-template-file": "--chat-template", "--cors-origins": "--allowed-origins", "-fa": "-fa"}
DROP_VALUE = {"--temp", "--seed", "--hf-repo", "--hf-file", "--model-url", "--threads", "--n-gpu-layers",
              "--pooling", "--tags", "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type",
              "--spec-draft-n-max", "--spec-draft-n-min", "--reasoning-format", "--reasoning", "--chat-template",
              "--mmproj-url", "--media-path", "--sleep-idle-seconds", "--cache-ram", "--models-dir",
              "--models-max", "--models-preset", "--model-draft", "--tools", "--tools-runtime",
              "--mcp-servers-config", "--mcp-servers-json", "--spec-synth-len", "--spec-synth-rates"}
out, model, argv, i = [], None, sys.argv[1:], 0
while i < len(argv):
    a = argv[i]
    if a == "--cors-origins" and argv[i + 1:i + 2] == ["localhost"]:
        i += 2                                  # localhost's origins: allowed by default
    elif a in VALUE and i + 1 < len(argv):
        out += [VALUE[a], argv[i + 1]]
        i += 2
    elif a in ("--model", "-m") and i + 1 < len(argv):
        model = argv[i + 1] if os.path.isfile(argv[i + 1]) else None
        i += 2
    elif a in DROP_VALUE:
        i += 2
    else:
        i += 1                                  # a switch localinfer serve has no use for
if "-fa" in out:
    k = out.index("-fa")
    out[k + 1] = {"on": "on", "off": "off"}.get(out[k + 1], "auto")
cmd = [sys.executable, "-m", "localinfer", "serve", *([model] if model else []), "-t", "1", *out]
print("localinfer shim:", " ".join(cmd), file=sys.stderr, flush=True)
os.execv(sys.executable, cmd)
'''

PLUGIN = r'''
import signal, sys, types
sys.modules.setdefault("wget", types.ModuleType("wget"))      # only used to download models
PER_TEST_S = int(__import__("os").environ.get("SUITE_PER_TEST_S", "180"))

def pytest_sessionstart(session):
    import utils
    utils.ServerPreset.load_all = staticmethod(lambda: None)      # it downloads every model

def _alarm(signum, frame):
    raise TimeoutError(f"the test ran past {PER_TEST_S} s")

import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_TEST_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def classify(file: str, name: str, text: str) -> str:
    known = KNOWN.get(name.split("[")[0])
    if known is not None:
        return known[0]
    if file in ONLY_FILES or any(w in text for w in ONLY_WORDS) or "no route" in text:
        return "llama-server only"
    if any(w in text for w in MODEL_WORDS):
        return "model-specific text"
    return "ours"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default=",".join(DEFAULT_FILES))
    ap.add_argument("--per-test-s", type=int, default=180)
    ap.add_argument("--out", default=None)
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--junit", default=None, help="count an earlier run's junit XML instead of running")
    args = ap.parse_args()
    src = subprocess.run(["bash", str(REPO / "scripts" / "llama_sources.sh")], check=False, capture_output=True,
                         text=True)
    if src.returncode != 0:
        print(src.stderr.strip(), file=sys.stderr)
        return 1
    tests = Path(src.stdout.strip()) / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
    work = Path(tempfile.mkdtemp(prefix="llama-suite-"))
    shim = work / "llama-server"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    (work / "llama_suite_plugin.py").write_text(PLUGIN)
    junit = work / "junit.xml"
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(shim), PORT=str(free_port()), SUITE_PER_TEST_S=str(args.per_test_s),
               PYTHONPATH=os.pathsep.join([str(work), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("LOCALINFER_API_KEY", None)
    files = [str(tests / "unit" / f) for f in args.files.split(",") if f]
    cmd = [sys.executable, "-m", "pytest", "-p", "llama_suite_plugin", "-q", "-o", "addopts=", "--junitxml",
           str(junit), "-p", "no:cacheprovider", *(["-k", args.k] if args.k else []), *files]
    t0 = time.monotonic()
    if args.junit:
        junit = Path(args.junit)
    else:
        subprocess.run(cmd, cwd=tests, env=env, stdout=subprocess.DEVNULL if args.out else None, check=False)
    elapsed = time.monotonic() - t0
    rows, counts, by_file = [], Counter(), defaultdict(Counter)
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = (case.get("classname") or "").split(".")[-1] + ".py"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            kind = "skipped"
        elif bad is None:
            kind = "passed"
        else:
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            kind = classify(file, case.get("name") or "", text)
            first = next((ln.strip() for ln in (bad.get("message") or "").splitlines() if ln.strip()), "")
            why = KNOWN.get((case.get("name") or "").split("[")[0], ("", ""))[1]
            rows.append((kind, f"{file}::{case.get('name')}", f"{why}; {first[:120]}" if why else first[:160]))
        counts[kind] += 1
        by_file[file][kind] += 1
    kinds = ("passed", "model-specific text", "llama-server only", "ours", "skipped")
    head = (f"llama.cpp server tests ({tests.parent.parent.parent.name}: {args.files}) against localinfer serve "
            f"(embedded SmolLM2-135M, 1 thread), " + (f"counted from {args.junit}" if args.junit else f"{elapsed:.0f} s"))
    lines = [head,
             "total " + ", ".join(f"{k} {counts[k]}" for k in kinds), ""]
    for f, c in sorted(by_file.items()):
        lines.append(f"{f:32s} " + ", ".join(f"{k} {c[k]}" for k in kinds if c[k]))
    lines += ["", "failures:"] + [f"[{k}] {name}: {msg}" for k, name, msg in sorted(rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
