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


def test_engine_crash_gives_503_not_a_dead_server(server_factory):
    import json
    import os
    import re
    import signal
    import time

    server = server_factory("--max-model-len", "128")
    pid = int(re.search(r"engine core: pid (\d+)", server.log()).group(1))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while server.request("GET", "/health", timeout=10)[0] != 503:
        assert time.monotonic() < deadline, "/health never noticed the dead engine"
        time.sleep(0.2)
    status, headers, raw = server.request(
        "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert status == 503 and "retry-after" in headers
    assert "engine" in json.loads(raw)["error"]["message"]
    assert server.proc.poll() is None  # the HTTP server itself is still up
