"""`skyline chat`'s loop on the default model: Ctrl-C stops a reply (its request aborted, its
blocks freed) and not the program; /reset confirms; an unknown /command is reported, not sent."""

from __future__ import annotations

import io
import os
import signal

import pytest

from skyline.engine.frontend.llm import LLM
from skyline.tools.chat import run_chat
from skyline.types import SamplingParams


@pytest.fixture(scope="module")
def llm():
    llm = LLM(device="cpu", max_model_len=256, max_num_seqs=2)
    yield llm
    llm.shutdown()


class _Terminal(io.StringIO):
    """Collects what the chat writes; sends Ctrl-C (SIGINT) after the `interrupt_after`-th
    piece of a reply."""

    def __init__(self, interrupt_after: int | None = None) -> None:
        super().__init__()
        self.interrupt_after = interrupt_after
        self.pieces = 0
        self.replying = False

    def write(self, s: str) -> int:
        if self.replying and s:
            self.pieces += 1
            if self.pieces == self.interrupt_after:
                os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def _chat(llm, lines, term, **kw):
    feed = iter(lines)
    seen: list[str] = []

    def read(prompt: str) -> str:
        term.replying = False
        line = next(feed)  # StopIteration would be a bug: every script ends with /exit
        seen.append(line)
        term.replying = not line.startswith("/")
        return line

    run_chat(llm, SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 40)),
             read=read, out=term, **kw)
    return seen


def test_ctrl_c_stops_the_reply_not_the_program(llm):
    term = _Terminal(interrupt_after=3)
    free = llm.engine.scheduler.kv_manager.block_pool.num_free_blocks
    _chat(llm, ["Write a long story about a dragon.", "What is the capital of France?",
                "/exit"], term, max_tokens=200)
    text = term.getvalue()
    assert text.count("[stopped]") == 1
    story = text.split("[stopped]")[0].split("\n", 1)[1]
    assert 0 < len(story) < 100  # three pieces, not 200 tokens
    assert "Paris" in text.split("[stopped]")[1]  # the next question is answered
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.kv_manager.block_pool.num_free_blocks == free
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_commands(llm):
    term = _Terminal()
    _chat(llm, ["/help", "/frobnicate now", "/reset", "/quit", "never read"], term,
          system="Be brief.")
    text = term.getvalue()
    assert "/reset" in text and "forget the conversation" in text
    assert "unknown command /frobnicate; commands: /help, /reset, /exit" in text
    assert "conversation cleared (system prompt kept)" in text
    assert "never read" not in text and not llm.engine.has_unfinished()
