"""What a hostile or careless user does at the command line (issue 17): signals, output paths,
plan limits, resource caps.  Each test reproduces the original failure."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from localinfer.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_WITHIN = 1.5  # seconds from SIGTERM to exit ("about 1 s", with slack for a loaded 2-core machine)

# The child runs the CLI with two observation hooks on llama.cpp's callbacks: the first progress
# callback of a model load says "STATE load" and stays inside the callback for up to 0.5 s (so the
# signal lands there, as it does when a large model loads), and the first abort-callback poll of an
# abortable prefill says "STATE prefill".
DRIVER = r"""
import sys, time
import llama_cpp
try:
    from localinfer.util.signals import pending
except ImportError:  # before the fix
    pending = lambda: None
def hook(ctype, state, pause):
    orig = getattr(llama_cpp, ctype)
    def make(fn):
        if not callable(fn):
            return orig(fn)
        seen = []
        def wrapper(*a):
            if not seen:
                seen.append(1)
                sys.stderr.write("STATE " + state + "\n"); sys.stderr.flush()
                end = time.monotonic() + pause
                while time.monotonic() < end and pending() is None:
                    time.sleep(0.005)
            return fn(*a)
        return orig(wrapper)
    setattr(llama_cpp, ctype, make)
hook("llama_progress_callback", "load", 0.5)
hook("ggml_abort_callback", "prefill", 0.0)
from localinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Child:
    """The CLI in a subprocess, its stdout and stderr read as they come."""

    def __init__(self, *args: str, stdin: bool = False):
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], cwd=REPO,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out, self.err = [], []
        self.q: queue.Queue = queue.Queue()
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink):
        for chunk in iter(lambda: stream.read1(4096), b""):
            sink.append(chunk.decode("utf-8", "replace"))
            self.q.put(None)

    def stdout(self) -> str:
        return "".join(self.out)

    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, pred, timeout: float = 60) -> bool:
        end = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None or time.monotonic() > end:
                return pred()
            try:
                self.q.get(timeout=0.05)
            except queue.Empty:
                pass
        return True

    def terminate_and_wait(self, sig: int = signal.SIGTERM) -> float:
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running 30 s after SIGTERM; stderr: {self.stderr()[-2000:]}")
        took = time.monotonic() - start
        time.sleep(0.1)  # let the pumps drain
        return took

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _check_terminated(child: Child, took: float):
    err = child.stderr()
    assert child.proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    ours = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("STATE ", "loading "))]
    assert ours == ["terminated"], err[-2000:]
    assert took < EXIT_WITHIN, f"exit took {took:.2f} s"


@pytest.fixture
def child():
    made: list[Child] = []

    def start(*args, stdin=False):
        made.append(Child(*args, stdin=stdin))
        return made[-1]

    yield start
    for c in made:
        c.kill()


def test_sigterm_during_model_load_exits_143(child):
    c = child("run", "--raw", "-p", "hello", "-n", "4", "-t", "1")
    assert c.wait_for(lambda: "STATE load" in c.stderr()), c.stderr()
    _check_terminated(c, c.terminate_and_wait())
    assert c.stdout() == ""


def test_sigterm_during_prefill_exits_143(child, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog, " * 300)  # ~3000 tokens
    c = child("run", "--raw", "-f", str(prompt), "-n", "1", "-t", "1")
    assert c.wait_for(lambda: "STATE prefill" in c.stderr()), c.stderr()
    if c.stdout():
        pytest.skip("the prefill finished before the signal could be sent")
    took = c.terminate_and_wait()
    if c.stdout():
        pytest.skip("the prefill finished before the signal arrived")
    _check_terminated(c, took)


def test_sigterm_during_decode_exits_143(child):
    c = child("run", "--raw", "-p", "Once upon a time", "-n", "4000", "--ignore-eos", "-t", "1")
    assert c.wait_for(lambda: len(c.stdout()) > 20), c.stderr()
    if c.proc.poll() is not None:
        pytest.skip("the reply finished before the signal could be sent")
    _check_terminated(c, c.terminate_and_wait())


def test_sigterm_at_the_chat_prompt_exits_143(child):
    c = child("chat", "-t", "1", stdin=True)
    assert c.wait_for(lambda: ">>> " in c.stdout()), c.stderr()
    _check_terminated(c, c.terminate_and_wait())
    assert "Ctrl-D" not in c.stdout().split("\n", 1)[-1]


def test_sighup_at_the_chat_prompt_exits_129(child):
    # a closed terminal sends SIGHUP: chat leaves instead of waiting for input that never comes
    c = child("chat", "-t", "1", stdin=True)
    assert c.wait_for(lambda: ">>> " in c.stdout()), c.stderr()
    took = c.terminate_and_wait(signal.SIGHUP)
    err = c.stderr()
    assert c.proc.returncode == 129 and "Traceback" not in err and err.rstrip().endswith("terminated"), err
    assert took < EXIT_WITHIN


def test_sigterm_during_a_chat_reply_exits_143(child, tmp_path):
    saved = tmp_path / "t.json"
    c = child("chat", "-t", "1", "-n", "4000", "--ignore-eos", "--save", str(saved), stdin=True)
    assert c.wait_for(lambda: ">>> " in c.stdout()), c.stderr()
    c.proc.stdin.write(b"Tell me a very long story.\n")
    c.proc.stdin.flush()
    assert c.wait_for(lambda: len(c.stdout().split(">>> ", 1)[-1]) > 20), c.stderr()
    if c.proc.poll() is not None:
        pytest.skip("the reply finished before the signal could be sent")
    _check_terminated(c, c.terminate_and_wait())
    assert ">>> " not in c.stdout().split(">>> ", 1)[-1]  # did not go back to the prompt
    import json

    last = json.loads(saved.read_text())["messages"][-1]   # the partial reply was kept, marked
    assert last["role"] == "assistant" and last["interrupted"] is True and last["content"]


# ---- plan: numbers the device or the model cannot honour ------------------------------------------

def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(rc, out, err, *words):
    assert rc != 0 and out == "" and "Traceback" not in err, (rc, out, err)
    lines = err.splitlines()
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: ") and len(lines) == 2, err
    for w in words:
        assert w in err, err


def test_plan_kv_budget_beyond_the_device_is_refused(capsys):
    # was: planned with 931.32 GiB on a 24 GB card and said "fits"
    rc, out, err = _cli(capsys, "plan", "--device", "rtx-4090", "--kv-budget", "1TB")
    _refused(rc, out, err, "--kv-budget", "931.32 GiB", "rtx-4090")
    rc, out, err = _cli(capsys, "plan", "--device", "rtx-4090", "--kv-budget", "1GiB")
    assert rc == 0 and "KV budget 1.00 GiB" in out


def test_plan_input_beyond_the_trained_context_is_refused(capsys):
    # was: "the KV budget is negative: the weights alone do not fit" for a 92 MiB model on an H200
    rc, out, err = _cli(capsys, "plan", "--device", "h200", "--input", "2147483648")
    _refused(rc, out, err, "--input", "8192")
    assert "weights alone" not in err
    # was: planned a 1M-token context that `fit` refuses
    rc, out, err = _cli(capsys, "plan", "--device", "h200", "--input", "1000000")
    _refused(rc, out, err, "trained context 8192")


def test_plan_with_nothing_feasible_exits_non_zero(capsys):
    rc, out, _ = _cli(capsys, "plan", "--device", "h200", "--deadline", "0.0001")
    assert rc == 1 and "nothing is feasible" in out
    rc, out, _ = _cli(capsys, "plan", "--device", "h200", "--deadline", "100")
    assert rc == 0 and "best: " in out


# ---- output paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["report"], ["skeleton", "smollm2-135m"]])
def test_an_output_path_ending_in_slash_is_not_written_as_a_file(capsys, tmp_path, monkeypatch, argv):
    # was: wrote a file named newdir and printed "wrote newdir/"
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli(capsys, *argv, "-o", "newdir/")
    _refused(rc, out, err, "newdir/", "folder")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["report"], ["skeleton", "smollm2-135m"]])
def test_output_errors_name_the_path_not_a_temp_file(capsys, tmp_path, argv):
    # was: error: [Errno 21] Is a directory: '/.DIR.szh9ck79.tmp' -> '/DIR' (and no hint)
    for target, words in ((tmp_path, "is a directory"), (tmp_path / "missing" / "r.txt", "does not exist")):
        rc, out, err = _cli(capsys, *argv, "-o", str(target))
        _refused(rc, out, err, str(target), words)
        assert ".tmp" not in err and "Errno" not in err
    assert os.listdir(tmp_path) == []


def test_chat_save_to_a_bad_path_is_refused_before_the_model_loads(capsys, tmp_path):
    # was: checked only after the first reply, "the previous file is intact" when there was none, exit 0
    bad = tmp_path / "missing" / "t.json"
    rc, out, err = _cli(capsys, "chat", "--save", str(bad))
    _refused(rc, out, err, str(bad), "does not exist")
    assert "loading" not in err


def test_chat_save_command_and_autosave_errors_name_the_path(tmp_path):
    import io

    from localinfer.generation.chat import ChatSession
    from tests.support.fakes import ScriptedEngine

    out = io.StringIO()
    bad = tmp_path / "missing" / "t.json"
    session = ChatSession(ScriptedEngine(lambda t: None, 8), None, out=out, save_path=str(bad))
    assert session.command(f"/save {tmp_path}") is True
    session._autosave()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"error: {tmp_path} is a directory") and "hint" not in lines[0] and "e.g." in lines[0]
    assert str(bad) in lines[1] and "does not exist" in lines[1] and "intact" not in lines[1]
    assert ".tmp" not in out.getvalue() and os.listdir(tmp_path) == []


# ---- prompts too big to tokenize -------------------------------------------------------------------

def test_a_huge_raw_prompt_is_refused_by_bytes_before_tokenizing(capsys, tmp_path):
    # was: 66 MB tokenized in full (62.5 s, 4.3 GB) before "the prompt is 53541385 tokens"
    big = tmp_path / "big.txt"
    big.write_text("word " * 1_200_000)            # 6 MB: under the 8M-character template cap
    for extra in (["--raw"], []):                 # raw, and through the chat template
        start = time.monotonic()
        rc, out, err = _cli(capsys, "run", *extra, "-f", str(big), "-n", "1", "-t", "1")
        assert rc != 0 and out == "" and "Traceback" not in err
        assert "6,000," in err and "bytes" in err and "the context holds 4096" in err, err
        assert time.monotonic() - start < 5      # tokenizing 6 MB took several times that


def test_check_text_fits_never_refuses_what_could_fit():
    from localinfer.errors import ContextFullError
    from tests.support.fakes import ScriptedEngine

    engine = ScriptedEngine(lambda t: None, n_vocab=100, n_ctx=64)    # token_bytes: "<id> " (at most 3 bytes)
    assert engine.longest_token_bytes() == 3
    engine.check_text_fits(64)                    # 64 bytes could be 64 one-byte tokens... still passed on
    engine.check_text_fits(3 * 63)                # at least 63 tokens: could fit
    with pytest.raises(ContextFullError) as ei:
        engine.check_text_fits(3 * 64 + 1)
    assert ei.value.needed == 65 and ei.value.available == 64


def test_more_threads_than_cores_warns_and_caps(capsys):
    import json

    from localinfer.generation.load import usable_cores

    rc, out, err = _cli(capsys, "run", "-p", "hi", "-n", "1", "-t", "1000", "--json")
    cores = usable_cores()
    assert rc == 0 and json.loads(out)["plan"]["threads"] == cores
    assert f"warning: -t 1000 is more than the {cores} cores this process may use; using {cores}" in err


# ---- chat templates ------------------------------------------------------------------------------

def test_chat_with_a_template_that_cannot_render_does_not_open(capsys, tmp_path):
    # was: chat opened, every message failed, exit 0
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ raise_exception('broken template') }}")
    rc, out, err = _cli(capsys, "chat", "--chat-template", str(bad))
    assert rc != 0 and ">>>" not in out and "Traceback" not in err
    assert "error: the chat template cannot render a first message: chat template: broken template" in err
    assert "\nhint: " in err


def test_in_chat_errors_keep_the_hint():
    # was: the in-chat error dropped the hint that `run` prints
    import io

    from localinfer.errors import TemplateError
    from localinfer.generation.chat import ChatSession
    from tests.support.fakes import ScriptedEngine

    class Failing:
        def tokens(self, engine, messages, **kw):
            raise TemplateError("chat template: two turns only", hint="check the roles and order of the messages")

    out = io.StringIO()
    session = ChatSession(ScriptedEngine(lambda t: None, 8), Failing(), out=out)
    session.turn("hello")
    assert out.getvalue().startswith("error: chat template: two turns only; hint: check the roles and order")
    assert "not sent" in out.getvalue() and session.messages == []


# ---- valid GGUFs that are not complete models ------------------------------------------------------

@pytest.mark.parametrize("kind", ["vocab", "vocab-untyped", "adapter", "mmproj", "partial", "no-tensors"])
def test_inspect_shows_any_valid_gguf_and_says_what_it_is_not(capsys, tmp_path, kind):
    # was: inspect refused them ("llama.embedding_length is missing", "re-download or re-convert it")
    import json

    from tests.support.ggufgen import write_not_a_model

    path = write_not_a_model(tmp_path / f"{kind}.gguf", kind)
    rc, out, err = _cli(capsys, "inspect", str(path))
    assert rc == 0 and err == "", err
    note = [ln for ln in out.splitlines() if "(fit and run need a full model)" in ln]
    assert len(note) == 1 and "byte accounting" in out and "metadata" in out
    rc, out, _ = _cli(capsys, "inspect", str(path), "--json")
    assert rc == 0 and json.loads(out)["not_a_model"]
    for argv in (["fit", str(path), "--device", "h200"], ["run", str(path), "-p", "hi"]):
        rc, out, err = _cli(capsys, *argv)
        _refused(rc, out, err)
        assert "re-download" not in err or kind == "partial"
        if kind.startswith("vocab"):
            assert "vocab-only file: no weights" in err


# ---- wording -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["plan", "report"])
def test_an_unknown_kv_type_names_the_flag_once(capsys, cmd):
    # was: error: --kv: --kv: unknown KV type 'f17'
    rc, out, err = _cli(capsys, cmd, "--kv", "f17")
    _refused(rc, out, err, "unknown KV type 'f17'")
    assert err.count("--kv") == 1


def test_a_failed_context_does_not_hint_at_flags_run_lacks(capsys, monkeypatch):
    # was: run --ctx 16000000 --force hinted at --parallel, which run does not take
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_init_from_model", lambda model, params: None)
    rc, out, err = _cli(capsys, "run", "-p", "hi", "-n", "1", "-t", "1")
    assert rc != 0 and "could not create a context" in err and "Traceback" not in err
    assert "--parallel" not in err and "hint: try a smaller --ctx" in err


# ---- same class: numbers with no upper bound -------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["fit", "--ubatch", "99999999999999"], "--ubatch"),          # was: accepted silently
    (["fit", "--gpu-layers", "99999999999999"], "--gpu-layers"),
    (["fit", "--ctx", "99999999999999"], "--ctx"),
    (["run", "-p", "hi", "-ngl", str(1 << 32)], "--gpu-layers"),   # was: truncated to 0 by ctypes' int32
])
def test_numbers_past_what_the_engine_takes_are_refused(capsys, argv, flag):
    rc, out, err = _cli(capsys, *argv)
    _refused(rc, out, err, flag)


@pytest.mark.parametrize("argv", [["report", "{m}", "-o", "{m}"], ["chat", "{m}", "--save", "{m}"],
                                  ["bench", "{m}", "--json", "{m}"]])
def test_an_output_path_that_is_the_model_is_refused(capsys, tmp_path, default_model, argv):
    # was: report -o model.gguf (or chat --save / bench --json) replaced the model with text
    import shutil

    model = tmp_path / "m.gguf"
    shutil.copyfile(default_model, model)
    size = model.stat().st_size
    rc, out, err = _cli(capsys, *[a.format(m=model) for a in argv])
    _refused(rc, out, err, "refusing to write over it")
    assert model.stat().st_size == size


def test_chat_save_command_refuses_the_model_file(tmp_path, default_model):
    # was: /save MODEL.gguf replaced the model with the transcript
    import io
    import shutil

    from localinfer.backends.engine import LoadPlan
    from localinfer.generation.chat import ChatSession
    from tests.support.fakes import ScriptedEngine

    model = tmp_path / "m.gguf"
    shutil.copyfile(default_model, model)
    engine = ScriptedEngine(lambda t: None, 8)
    engine.plan = LoadPlan(model_path=str(model), n_ctx=4096, n_batch=64)
    out = io.StringIO()
    ChatSession(engine, None, out=out).command(f"/save {model}")
    assert "refusing to write over it" in out.getvalue() and model.stat().st_size == default_model.stat().st_size


@pytest.mark.parametrize("reader", ["transcript", "bench"])
def test_a_fifo_given_as_a_transcript_or_bench_file_is_refused_not_waited_on(tmp_path, reader):
    import signal as _signal

    from localinfer.errors import LocalinferError
    from localinfer.generation.chat import read_transcript
    from localinfer.plan.bench_import import load_bench

    fifo = tmp_path / "in.json"
    os.mkfifo(fifo)
    _signal.signal(_signal.SIGALRM, lambda *_: pytest.fail("blocked opening a FIFO"))
    _signal.alarm(5)
    try:
        with pytest.raises(LocalinferError, match="not a regular file"):
            (read_transcript if reader == "transcript" else load_bench)(str(fifo))
    finally:
        _signal.alarm(0)


def test_chat_reading_dev_zero_stops_at_the_line_cap():
    """Issue 32 item 7: `chat < /dev/zero` read one endless line (no newline) into memory without bound."""
    with open("/dev/zero", "rb") as zero:
        p = subprocess.run([sys.executable, "-m", "localinfer", "chat"], cwd=REPO, stdin=zero, check=False,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "input line is over" in p.stderr and "Traceback" not in p.stderr
