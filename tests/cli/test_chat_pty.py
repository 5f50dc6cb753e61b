"""The chat REPL through a real pseudo-terminal on the embedded model (pexpect)."""

import json
import os
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "
STATS = r"\[\d+ tokens"
BASE = ["-t", "1", "--temp", "0"]


def spawn(*args, timeout=180):
    env = dict(os.environ, TERM="dumb", INPUTRC="/dev/null", PYTHONUNBUFFERED="1")
    child = pexpect.spawn(sys.executable, ["-m", "localinfer", "chat", *BASE, *args], encoding="utf-8",
                          timeout=timeout, env=env, dimensions=(40, 200))
    child.expect_exact(PROMPT)
    return child


def finish(child):
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def test_a_conversation_with_interrupts_commands_and_transcripts(tmp_path):
    child = spawn("--ctx", "1024", "-n", "16")
    child.sendline("Hello!")
    child.expect(STATS)
    child.expect_exact(PROMPT)

    child.sendline("/help")
    child.expect_exact("/system TEXT")
    child.expect_exact(PROMPT)

    child.sendintr()  # Ctrl-C at the prompt: a hint, not an exit
    child.expect_exact("Ctrl-D")
    child.expect_exact(PROMPT)
    assert child.isalive()

    child.sendline("/set temp=nan")
    child.expect("finite number")
    child.sendline("/set max_tokens=2000")
    child.expect_exact("[max_tokens = 2000]")
    child.sendline("Tell me a very long story about a dragon and a knight.")
    child.expect_exact("knight.\r\n")  # the echo of the line
    child.expect(r"\w+ \w+ \w+")  # the reply is streaming
    sent = time.monotonic()
    child.sendintr()
    child.expect_exact("[interrupted]", timeout=10)
    latency = time.monotonic() - sent
    child.expect_exact(PROMPT)
    print(f"Ctrl-C to [interrupted]: {latency * 1000:.0f} ms (pty round trip included)")

    child.sendline("/set max_tokens=8")
    child.sendline("Thanks.")
    child.expect(STATS)  # the next turn works
    child.expect_exact(PROMPT)

    path = tmp_path / "chat.json"
    child.sendline(f"/save {path}")
    child.expect_exact("[saved 6 messages")
    doc = json.loads(path.read_text())
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"] * 3
    assert doc["messages"][3].get("interrupted") is True and doc["messages"][3]["content"]
    assert doc["messages"][2]["content"].startswith("Tell me a very long story")

    child.sendline(f"/load {path}")
    child.expect_exact("[loaded 6 messages")
    child.sendline("/load /nonexistent/file.json")
    child.expect_exact("cannot read")
    child.sendline("/stats")
    child.expect("memory: weights=")
    child.sendline("/bogus")
    child.expect_exact("unknown command")
    child.expect_exact(PROMPT)
    assert finish(child) == 0
    assert not list(tmp_path.glob(".*.tmp"))  # no temp files left behind


def test_full_context_stops_with_a_message_and_the_repl_survives():
    child = spawn("--ctx", "128", "-n", "200", "--ignore-eos")
    child.sendline("Hi")
    child.expect_exact("[context full")
    child.expect_exact(PROMPT)
    child.sendline("word " * 150)
    child.expect_exact("[context full")
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_context_shift_drops_the_oldest_turns():
    child = spawn("--ctx", "128", "-n", "16", "--ignore-eos", "--context-shift")
    for i in range(4):
        child.sendline(f"Turn {i}: say something.")
        child.expect(STATS)
        child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(r"messages: (\d+) \((\d+) in view\)")
    assert int(child.match.group(1)) == 8 and int(child.match.group(2)) < 8
    assert finish(child) == 0


def test_template_errors_keep_the_repl_alive(tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% if messages | length > 2 %}{{ raise_exception('two turns only') }}{% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "<|im_start|>assistant\n")
    child = spawn("--ctx", "512", "-n", "4", "--chat-template", str(tpl))
    child.sendline("one")
    child.expect(STATS)
    child.sendline("two")
    child.expect_exact("two turns only")
    child.expect_exact("not sent")
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("[conversation cleared]")
    child.sendline("three")
    child.expect(STATS)
    assert finish(child) == 0
