"""`mfgguf chat` driven through a real pseudo-terminal, as a person would use it."""

from __future__ import annotations

import time

import pexpect

from .conftest import MFGGUF

PROMPT = ">>> "


def _spawn(gguf, *args):
    return pexpect.spawn(MFGGUF, ["chat", str(gguf), *args], encoding="utf-8", timeout=60,
                         dimensions=(40, 200), env={"TERM": "dumb", "PATH": "/usr/bin:/bin"})


def _finish(child) -> str:
    child.expect(pexpect.EOF)
    child.close()
    return child.before


def test_chat_session(tiny_gguf):
    child = _spawn(tiny_gguf, "--max-tokens", "24", "--seed", "1")
    try:
        child.expect(PROMPT)
        assert "/reset" in child.before  # the banner says how to use it
        child.sendline("def main():")
        child.expect(PROMPT)
        reply = child.before.split("def main():", 1)[1].strip()
        assert reply and "Traceback" not in reply
        child.sendline("/reset")
        child.expect(r"\(new conversation\)")
        child.expect(PROMPT)
        child.sendline("/nonsense")
        child.expect("unknown command")
        child.expect(PROMPT)
        child.sendline("import os")
        child.expect(PROMPT)
        child.sendline("/quit")
        out = _finish(child)
        assert child.exitstatus == 0 and "Traceback" not in out
    finally:
        child.terminate(force=True)


def _interrupt(child) -> None:
    """Ctrl-C during a reply until it says [stopped]: a SIGINT that lands while the terminal is still
    being set up for the reply can be lost (as a person would, press it again after a while)."""
    for _ in range(3):
        child.sendintr()
        if child.expect([r"\[stopped\]", pexpect.TIMEOUT], timeout=10) == 0:
            return
    raise AssertionError("Ctrl-C did not stop the reply: " + child.before[-200:])


def test_ctrl_c_stops_a_reply_and_ctrl_d_leaves(talker_gguf):
    child = _spawn(talker_gguf, "--max-tokens", "4000")  # this model never stops on its own
    try:
        child.expect(PROMPT)
        child.sendline("tell me everything")
        child.expect("everything")  # the echo of the line
        child.expect(r"\w{3,}")  # the reply is streaming
        child.expect(r"\w{3,}")
        _interrupt(child)  # Ctrl-C
        child.expect(PROMPT, timeout=20)
        # Ctrl-C at the prompt: stays. Wait as a person would: a SIGINT landing between
        # readline drawing the prompt and blocking on input is only seen at the next key.
        time.sleep(0.5)
        child.sendintr()
        child.expect("Ctrl-D or /quit to leave")
        child.expect(PROMPT)
        child.sendline("again")  # the model still works after an interrupted reply
        child.expect("again")
        child.expect(r"\w{3,}")
        _interrupt(child)
        child.expect(PROMPT, timeout=20)
        child.sendeof()  # Ctrl-D
        out = _finish(child)
        assert child.exitstatus == 0, out
        assert "Traceback" not in child.before
    finally:
        child.terminate(force=True)


def test_the_banner_names_the_experts_and_show_experts_names_a_replys(tiny_gguf):
    child = _spawn(tiny_gguf, "--max-tokens", "16", "--seed", "1", "--show-experts", "--experts-per-token", "2")
    try:
        child.expect(PROMPT)
        assert "experts: c, english, python; 2 a token" in child.before  # the file's labels, the count asked
        child.sendline("for x in items:")
        child.expect(PROMPT)
        line = child.before.strip().splitlines()[-1]
        assert line.startswith("(experts: ") and any(d in line for d in ("c ", "english ", "python ")), line
        child.sendline("/quit")
        out = _finish(child)
        assert child.exitstatus == 0 and "Traceback" not in out
    finally:
        child.terminate(force=True)
