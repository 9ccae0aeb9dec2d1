"""A real `skyline serve` in a subprocess on a free localhost port, with the default model."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from skyline.router import launch

STARTUP_TIMEOUT = 180.0
CLIENT_TIMEOUT = 120.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A port for a server that binds it only after loading its model: from outside the
    ephemeral range, which other tests' outgoing connections draw from meanwhile."""
    return launch.free_port()


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str
    api_key: str | None = None  # sent with every request made through `request`

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            hdrs = {"Content-Type": "application/json", **auth, **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, _, body = self.request("GET", "/metrics", timeout=30)
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and the KV cache is empty."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["skyline:num_requests_running"] == 0
                    and m["skyline:num_requests_waiting"] == 0
                    and m["skyline:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def engine_pid(self) -> int:
        """The live engine core's pid, as the log last gave it (at startup or a restart)."""
        return int(re.findall(r"engine core(?:: pid| restarted \(pid) (\d+)", self.log())[-1])

    def post(self, body: dict, out: list, timeout: float = 60.0) -> None:
        """POST `body` to /v1/completions on a connection of its own; append (status, the
        whole body) to `out`."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            out.append((resp.status, resp.read()))
        finally:
            conn.close()

    def cut_under_load(self, body: dict, num: int, running: int, cut: Callable[[], None],
                       word: str, join_timeout: float = 60.0) -> None:
        """`num` requests of `body` (every other one streamed) from threads; once `running`
        of them run, `cut()` (kill the engine, SIGTERM the server): each must end with a 503
        error whose message has `word` (a stream: an error event, then [DONE])."""
        results: list = []
        threads = [threading.Thread(target=self.post, args=({**body, "stream": i % 2 == 0},
                                                            results)) for i in range(num)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while self.metrics()["skyline:num_requests_running"] < running:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.1)
        cut()
        for t in threads:
            t.join(join_timeout)
        assert len(results) == num
        for status, raw in results:
            if status == 200:
                events = [e for e in raw.decode().split("\n\n") if e]
                assert events[-1] == "data: [DONE]", events[-3:]
                err = json.loads(events[-2][len("data: "):])["error"]
            else:
                assert status == 503, raw
                err = json.loads(raw)["error"]
            assert err["code"] == 503 and word in err["message"], err

    def hostile_smoke(self) -> dict[str, Any]:
        """bench/hostile.py's smoke mix against this server: its record, checked for no
        unexpected 5xx, no leaked KV block and /health answered throughout."""
        r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "hostile.py"),
                            "--smoke", "--base-url", f"http://127.0.0.1:{self.port}"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        record = json.loads(r.stdout)
        assert record["unexpected_5xx"] == 0 and record["leaked_kv_blocks"] == 0
        assert record["health"]["statuses"] == {"200": record["health"]["probes"]}
        return record

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp_dir: str, *args: str) -> Server:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "skyline.cli", "serve", "--port", str(port),
           "--kv-cache-memory", "256MiB", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    server = Server(proc, port, log_path, key)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited during startup:\n{server.log()}")
        try:
            status, _, _ = server.request("GET", "/health", timeout=2)
            if status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop(signal.SIGKILL)
    pytest.fail(f"the server did not start in {STARTUP_TIMEOUT}s:\n{server.log()}")


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    started: list[Server] = []

    def factory(*args: str) -> Server:
        s = start_server(str(tmp_path_factory.mktemp("server")), *args)
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's `server` fixture."""
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=CLIENT_TIMEOUT,
                         max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    """The id of the model the module's server serves."""
    return client.models.list().data[0].id
