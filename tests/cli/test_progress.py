"""Progress bars: shown on a terminal, not with --quiet, never into a pipe or a log."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import struct
import subprocess
import sys
import termios

from skyline import progress


def _terminal_stderr(*args: str) -> str:
    """Runs `skyline ARGS` with stderr on a pseudo-terminal; returns what it wrote there."""
    cmd = [sys.executable, "-m", "skyline.cli", *args]
    master, slave = os.openpty()
    # a terminal of 24 x 120 (a new pseudo-terminal has 0 columns, where tqdm draws nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=240) == 0
    return b"".join(chunks).decode(errors="replace")


def test_loading_shows_a_bar_on_a_terminal_only():
    args = ("generate", "hi", "--max-tokens", "1", "--max-model-len", "64", "--raw")
    assert "loading SmolLM2" in _terminal_stderr(*args)
    assert "loading" not in _terminal_stderr(*args, "--quiet")


def test_enabled_follows_the_logger_and_the_terminal(monkeypatch):
    level = progress.LOGGER.level
    try:
        tty = io.StringIO()
        tty.isatty = lambda: True  # type: ignore[method-assign]
        monkeypatch.setattr(sys, "stderr", tty)
        progress.set_enabled(True)
        assert progress.enabled()
        for _ in progress.bar(range(3), desc="counting"):
            pass
        assert "counting" in tty.getvalue()
        progress.set_enabled(False)
        assert not progress.enabled()
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a file
        progress.set_enabled(True)
        assert not progress.enabled()
    finally:
        progress.LOGGER.setLevel(level or logging.NOTSET)
