"""Failures: a server that cannot start says why in one line (no traceback); an engine that dies
turns requests into 503s instead of hangs."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skyline.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_missing_model_is_one_clean_line(tmp_path):
    r = _serve("--model", str(tmp_path / "no-such-model.gguf"), "--port", "0")
    assert r.returncode != 0
    assert "not found" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("skyline: error:")


def test_port_in_use_is_one_clean_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _serve("--port", str(port))
    assert r.returncode != 0
    assert "cannot listen" in r.stderr and "Traceback" not in r.stderr


def test_engine_that_cannot_be_restarted_stops_the_server(server_factory):
    """With no restarts allowed, a dead engine fails what was in flight with 503 and the server
    exits non-zero with one line, for its own supervisor to restart it."""
    import os
    import re
    import signal

    server = server_factory("--max-model-len", "128", "--max-engine-restarts", "0")
    pid = int(re.search(r"engine core: pid (\d+)", server.log()).group(1))
    os.kill(pid, signal.SIGKILL)
    assert server.proc.wait(30) == 1
    last = server.log().strip().splitlines()[-1]
    assert last.startswith("skyline: error: the engine core failed 1 times"), last
