"""`skyline chat`: a conversation in the terminal. Ctrl-C while a reply streams stops that
reply (its request is aborted, its KV blocks freed) and keeps the program; lines that start
with "/" are commands, never sent to the model ("//" sends one "/")."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TextIO

from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "quit (also /quit or Ctrl-D)",
}


class _StopOnInterrupt:
    """While active, Ctrl-C (SIGINT) sets `hit` instead of raising KeyboardInterrupt, so the
    reply stops between two engine steps, never inside one."""

    def __init__(self) -> None:
        self.hit = False
        self._previous: Any = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.hit = True

    def __enter__(self) -> _StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _command(line: str, out: TextIO) -> str | None:
    """The command a "/" line names ("/quit" is "/exit"), or None after reporting an unknown
    one."""
    name = line.split()[0].lower()
    name = "/exit" if name == "/quit" else name
    if name in COMMANDS:
        return name
    out.write(f"unknown command {name}; commands: {', '.join(COMMANDS)} (start a message "
              "with // to send a /)\n")
    return None


def run_chat(llm: LLM, params: SamplingParams, system: str | None = None,
             read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
    """The chat loop: read a line, run a command or stream the model's reply, until /exit or
    end of input (Ctrl-D; Ctrl-C at the prompt quits too)."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    out.write(f"skyline chat: {llm.config.model.name} (/help for commands; Ctrl-C stops a "
              "reply, Ctrl-D quits)\n")
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            command = _command(text, out)
            if command == "/exit":
                return
            if command == "/reset":
                history = list(start)
                out.write("conversation cleared" + (" (system prompt kept)" if start else "")
                          + "\n")
            elif command == "/help":
                out.write("".join(f"  {c:8} {what}\n" for c, what in COMMANDS.items()))
            continue
        history.append({"role": "user", "content": line[1:] if text.startswith("//") else line})
        reply = []
        with _StopOnInterrupt() as interrupt:
            stream = llm.stream(llm.render_chat(history), params)
            try:
                for delta in stream:
                    reply.append(delta.outputs[0].text)
                    out.write(delta.outputs[0].text)
                    out.flush()
                    if interrupt.hit:
                        break
            finally:
                stream.close()  # aborts the request if it is still running
        out.write("\n[stopped]\n" if interrupt.hit else "\n")
        # A stopped reply stays in the conversation as far as it got.
        history.append({"role": "assistant", "content": "".join(reply)})
