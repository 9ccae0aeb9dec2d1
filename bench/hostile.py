"""Hostile traffic against a real `skyline serve`: what one abusive client can do to a server,
and whether everyone else is still served while it does it.

The abuse mix, in rounds: random JSON bodies of the request schemas (seeded), values that
overflow the engine's types and strings that are not Unicode, 10 MB bodies (one huge message, a
flood of tiny ones, a huge /tokenize), a burst far beyond the waiting queue, a body that never
arrives, malformed HTTP, clients that leave mid-stream, and (when this script started the
server) the engine core killed with SIGKILL. Meanwhile /health is probed every 50 ms and a well-
behaved client sends small requests. At the end: the statuses by code, the engine restarts and
the KV blocks still held once the server is idle (0 expected), from /metrics.

    python bench/hostile.py --smoke                       # seconds of traffic (CI)
    python bench/hostile.py                               # the full mix, JSON to bench/results/
    python bench/hostile.py --smoke --base-url http://127.0.0.1:8000   # a running server
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import http.client
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

RESULT = "bench/results/reliability/hostile-cpu.json"
SERVE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "256MiB"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]

# ------------------------------------------------------------------------ bodies

_INTS = [0, 1, -1, 2, 7, 64, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]
_FLOATS = [0.0, -0.0, 0.5, 1.0, 2.0, -2.5, 1e308, 1e-308, 3.4]
_STRINGS = ["", "hi", "Hello, how are you?", "a\ud800b", "\udc00", "\x00\x01", "line\nINFO forged",
            "é" * 3, "{{ 1/0 }}", "x" * 3000, "<|im_end|>", " " * 50]
_FIELDS: dict[str, list[Any]] = {
    "model": [None, "nope", 5],
    "n": _INTS, "temperature": _FLOATS + _INTS, "top_p": _FLOATS, "top_k": _INTS,
    "min_p": _FLOATS, "presence_penalty": _FLOATS, "frequency_penalty": _FLOATS,
    "repetition_penalty": _FLOATS, "seed": _INTS, "min_tokens": _INTS,
    "max_tokens": [1, 2, 4, 8] + _INTS, "max_completion_tokens": _INTS,
    "stop": [None, "x", [], ["a", "b"], ["\ud800"], ["y"] * 100, 5],
    "stop_token_ids": [[], [1], [2**64], [-1], ["a"]], "stream": [True, False, "yes"],
    "stream_options": [{"include_usage": True}, {"include_usage": "x"}, []],
    "logprobs": [True, False, 0, 5, 21, 2**64], "top_logprobs": [0, 5, 20, 21, -1],
    "echo": [True, False], "ignore_eos": [True, False], "user": _STRINGS,
    "logit_bias": [{}, {"1": 5}], "best_of": [1, 2], "suffix": [None, "x"],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "xml"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"type": "integer"}}}}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}],
    "tools": [[], [{"type": "function", "function": {"name": "f"}}], [{}] * 300],
    "tool_choice": ["none", "auto", None],
    "chat_template_kwargs": [{}, {"enable_thinking": True}, {"chat_template": "{{ 1/0 }}"},
                             {"bos_token": "X"}, {"x": [1, {"y": "z"}]}],
    "add_generation_prompt": [True, False], "add_special_tokens": [True, False],
}


def _message(rng: random.Random) -> Any:
    roles = ["user", "system", "assistant", "developer", "tool", "wizard", None]
    content = rng.choice([*_STRINGS, None, [{"type": "text", "text": "hi"}],
                          [{"type": "image_url", "image_url": {"url": "http://x"}}], 5])
    msg = {"role": rng.choice(roles), "content": content}
    return msg if rng.random() > 0.05 else rng.choice([[], "hi", 3, {}])


def fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    """One random request: mostly the right shape with hostile values, sometimes garbage."""
    path = rng.choice(PATHS)
    roll = rng.random()
    if roll < 0.06:  # not JSON, or JSON of the wrong shape
        return path, rng.choice([b"{not json", b"[1, 2]", b"", b"null", b"\xff\xfe{}",
                                 b"[" * 5000, b'{"a": ' * 3000, b'"' + b"x" * 1000])
    body: dict[str, Any] = {}
    if path == "/v1/chat/completions" or (path == "/tokenize" and rng.random() < 0.5):
        body["messages"] = [_message(rng) for _ in range(rng.choice([0, 1, 1, 2, 3, 40]))]
    elif path == "/detokenize":
        body["tokens"] = rng.choice([[1, 2, 3], [], [-1], [2**64], list(range(50)), "x"])
    else:
        body["prompt"] = rng.choice([*_STRINGS, [1, 2, 3], [[1, 2], [3]], ["a", "b"], [],
                                     [2**63], [[]], 7])
    for name in rng.sample(sorted(_FIELDS), rng.randint(0, 6)):
        body[name] = rng.choice(_FIELDS[name])
    if "max_tokens" not in body and rng.random() < 0.8:
        body["max_tokens"] = rng.choice([1, 4, 8])  # keep most generations short
    return path, json.dumps(body).encode()


def hostile_bodies() -> list[tuple[str, bytes]]:
    """Fixed cases that once crashed or stalled the server (issue 24)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases: list[dict[str, Any]] = [
        {**chat, "top_k": 2**63}, {**chat, "min_tokens": 2**64}, {**chat, "seed": 2**64 - 1,
                                                                   "n": 3},
        {**chat, "messages": [{"role": "user", "content": "a\ud800b"}]},
        {**chat, "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}"
                                          "{% for j in range(99999) %}{% endfor %}{% endfor %}"}},
        {**chat, "stop": ["s"] * 200_000}, {**chat, "n": 10_000},
        {**chat, "user": "bob\nINFO skyline.server: forged line"},
    ]
    out = [("/v1/chat/completions", json.dumps(c).encode()) for c in cases]
    out += [("/v1/completions", json.dumps({"prompt": "a\ud800b"}).encode()),
            ("/tokenize", json.dumps({"prompt": "a\udc00"}).encode())]
    return out


def big_bodies(size: int = 10 << 20) -> list[tuple[str, bytes]]:
    """Bodies of about `size` bytes: one huge message, a flood of tiny ones, a huge /tokenize."""
    one = {"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 2}
    tiny = {"messages": [{"role": "user", "content": "x"}] * (size // 34), "max_tokens": 2}
    return [("/v1/chat/completions", json.dumps(one).encode()),
            ("/v1/chat/completions", json.dumps(tiny).encode()),
            ("/tokenize", json.dumps({"prompt": "word " * (size // 5)}).encode())]


# ------------------------------------------------------------------------ HTTP


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None = None

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None) -> Target:
        u = urllib.parse.urlsplit(url)
        return cls(u.hostname or "127.0.0.1", u.port or 80, api_key)

    def request(self, method: str, path: str, body: bytes | None = None,
                timeout: float = 60.0) -> tuple[int | str, bytes]:
        """(status, body), or ("timeout" | "error", b"") when no response came."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except TimeoutError:
            return "timeout", b""
        except OSError:
            return "error", b""
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, body = self.request("GET", "/metrics", timeout=30)
        out: dict[str, float] = {}
        if status != 200:
            return out
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def raw(self, data: bytes, timeout: float) -> int | str:
        """Send raw bytes on a fresh connection; the status of what comes back."""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as s:
                s.sendall(data)
                reply = s.recv(4096)
        except TimeoutError:
            return "timeout"
        except OSError:
            return "error"
        m = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
        return int(m.group(1)) if m else "error"


@dataclass
class Tally:
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    by_kind: dict[str, collections.Counter[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, status: int | str) -> None:
        with self.lock:
            self.statuses[str(status)] += 1
            self.by_kind.setdefault(kind, collections.Counter())[str(status)] += 1

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())


class HealthProbe:
    """GET /health every `interval` seconds from a thread; latencies in seconds."""

    def __init__(self, target: Target, interval: float = 0.05) -> None:
        self.target, self.interval = target, interval
        self.latencies: list[float] = []
        self.statuses: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            status, _ = self.target.request("GET", "/health", timeout=30)
            self.latencies.append(time.perf_counter() - t)
            self.statuses[str(status)] += 1
            self._stop.wait(self.interval)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]

        def pct(q: float) -> float:
            return round(lat[min(int(q * len(lat)), len(lat) - 1)] * 1000, 1)

        return {"probes": len(self.latencies), "statuses": dict(self.statuses),
                "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": round(lat[-1] * 1000, 1),
                "mean_ms": round(statistics.fmean(lat) * 1000, 1)}


# ------------------------------------------------------------------------ the abuse mix


def _many(target: Target, tally: Tally, kind: str, items: list[tuple[str, bytes]],
          concurrency: int, timeout: float = 120.0) -> None:
    def one(item: tuple[str, bytes]) -> None:
        tally.add(kind, target.request("POST", item[0], item[1], timeout)[0])

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, items))


def burst(target: Target, tally: Tally, n: int, max_tokens: int = 32) -> None:
    body = json.dumps({"prompt": "Write a long story.", "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    _many(target, tally, "burst", [("/v1/completions", body)] * n, concurrency=n)


def slow_body(target: Target, tally: Tally, timeout: float) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n")
    if target.api_key:
        head += b"Authorization: Bearer " + target.api_key.encode() + b"\r\n"
    tally.add("slow_body", target.raw(head + b"\r\n", timeout))


def malformed(target: Target, tally: Tally) -> None:
    for data in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                 b"GARBAGE\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n"):
        tally.add("malformed_http", target.raw(data, 10))


def disconnects(target: Target, tally: Tally, n: int) -> None:
    body = json.dumps({"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    for _ in range(n):
        conn = http.client.HTTPConnection(target.host, target.port, timeout=60)
        try:
            headers = {"Content-Type": "application/json"}
            if target.api_key:
                headers["Authorization"] = f"Bearer {target.api_key}"
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            resp = conn.getresponse()
            tally.add("disconnect", resp.status)
            resp.readline()
        except OSError:
            tally.add("disconnect", "error")
        finally:
            conn.close()  # mid-stream


def well_behaved(target: Target, tally: Tally, n: int) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}],
                       "max_tokens": 4}).encode()
    for _ in range(n):
        tally.add("well_behaved", target.request("POST", "/v1/chat/completions", body, 120)[0])


# ------------------------------------------------------------------------ the server


class OwnServer:
    """`skyline serve` started by this script, so that its engine can be killed."""

    def __init__(self, flags: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="hostile-"), "server.log")
        cmd = [sys.executable, "-m", "skyline.cli", "serve", "--port", str(self.port), *flags]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.target = Target("127.0.0.1", self.port)
        self.wait_ready(240)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.target.request("GET", "/health", timeout=5)[0] != 200:
            if self.proc.poll() is not None:
                sys.exit(f"the server exited:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                sys.exit("the server did not become healthy in time")
            time.sleep(0.25)

    def kill_engine(self) -> float:
        """SIGKILL the engine core; the seconds until the server serves again."""
        pids = re.findall(r"engine core(?:: pid| restarted \(pid) (\d+)", self.log())
        t = time.monotonic()
        os.kill(int(pids[-1]), signal.SIGKILL)
        while self.target.request("GET", "/health", timeout=5)[0] == 200:
            if time.monotonic() - t > 10:
                sys.exit("the server never noticed its engine died")
            time.sleep(0.02)
        self.wait_ready(120)
        return time.monotonic() - t

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def wait_idle(target: Target, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = target.metrics()
        idle = (m and m.get("skyline:num_requests_running") == 0
                and m.get("skyline:num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def run(target: Target, server: OwnServer | None, rounds: int, smoke: bool,
        seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tally = Tally()
    t0 = time.monotonic()
    big = big_bodies(2 << 20 if smoke else 10 << 20)
    recovery: list[float] = []  # seconds from each engine kill to serving again
    with HealthProbe(target) as probe:
        for r in range(rounds):
            # a body that never arrives holds its connection for the server's --body-timeout:
            # alongside the rest of the round
            slow = threading.Thread(target=slow_body, args=(target, tally, 120))
            if not smoke:
                slow.start()
            _many(target, tally, "fuzz", [fuzz_body(rng) for _ in range(12 if smoke else 60)],
                  concurrency=4 if smoke else 8)
            _many(target, tally, "hostile", hostile_bodies(), concurrency=4)
            _many(target, tally, "big_body", [big[r % len(big)]], concurrency=1)
            burst(target, tally, *((8, 8) if smoke else (100, 32)))
            malformed(target, tally)
            disconnects(target, tally, 2 if smoke else 5)
            well_behaved(target, tally, 2 if smoke else 5)
            if not smoke:
                slow.join()
            # the last round runs on the last engine, so that the leak check below means
            # something
            if server is not None and not smoke and r % 2 == 0 and r < rounds - 1:
                recovery.append(round(server.kill_engine(), 2))
        m = wait_idle(target, 60)
    return {
        "requests_sent": tally.sent,
        "statuses": dict(sorted(tally.statuses.items())),
        "statuses_by_kind": {k: dict(sorted(v.items())) for k, v in tally.by_kind.items()},
        "engine_kills": len(recovery),
        "recovery_seconds": recovery,
        "engine_restarts": m.get("skyline:engine_restarts_total"),
        "leaked_kv_blocks": m.get("skyline:kv_cache_used_blocks"),
        "health": probe.summary(),
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one short round (seconds)")
    ap.add_argument("--base-url", default=None,
                    help="a running server (default: start one; engine kills need that)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--rounds", type=int, default=None, help="default: 1 smoke, 6 full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help=f"JSON (default: {RESULT}, full mode only)")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="API processes of the server this script starts (serve's flag)")
    ns = ap.parse_args()
    flags = SERVE_FLAGS + (["--api-server-count", str(ns.api_server_count)]
                           if ns.api_server_count != 1 else [])
    load_before = os.getloadavg()[0]  # the CPU machine is shared: latencies depend on it
    server = None
    if ns.base_url:
        target = Target.from_url(ns.base_url, ns.api_key)
    else:
        server = OwnServer(flags)
        target = server.target
    try:
        result = run(target, server, ns.rounds or (1 if ns.smoke else 6), ns.smoke, ns.seed)
    finally:
        exit_code = server.stop() if server is not None else None
    result["server_exit_code"] = exit_code
    five = {k: v for k, v in result["statuses"].items() if k.startswith("5") and k != "503"}
    result["unexpected_5xx"] = sum(five.values())
    record = {
        "command": "python bench/hostile.py" + (" --smoke" if ns.smoke else "")
        + (f" --api-server-count {ns.api_server_count}" if ns.api_server_count != 1 else ""),
        "serve_flags": flags if server is not None else None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "date": datetime.date.today().isoformat(),
        "seed": ns.seed,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **result,
    }
    print(json.dumps(record, indent=2))
    out = ns.output or (None if ns.smoke else RESULT)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    if result["unexpected_5xx"] or (result["leaked_kv_blocks"] or 0) > 0:
        sys.exit("hostile traffic got a 5xx other than 503, or leaked KV blocks")


if __name__ == "__main__":
    main()
