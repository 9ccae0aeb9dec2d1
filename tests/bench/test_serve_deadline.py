"""`bench serve` never waits without bound on a server: a stream that stalls is cut at the hard
deadline (duration + grace) and the run reports what it has; set-up requests that get no answer
end the run with one sentence. Each run sits in a thread joined with a timeout, so a client that
waits forever fails the test instead of hanging it."""

from __future__ import annotations

import json
import socketserver
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from http_stub import read_request

from skyline.bench.serve import CUT, LoadSpec, run_serve_bench
from skyline.bench.workloads import WorkloadSpec


class _StallingHandler(socketserver.StreamRequestHandler):
    """A tiny OpenAI-style server: /v1/models, /tokenize (one id a word) and streamed
    completions; completion calls from number `stall_from` on send one token, then nothing."""

    server: Any

    def handle(self) -> None:
        request, body = read_request(self)
        if request.startswith("GET /v1/models"):
            if self.server.stall_models:
                self.server.stop.wait()
                return
            self._json({"data": [{"id": "m"}]})
        elif request.startswith("POST /tokenize"):
            self._json({"tokens": list(range(1, len(body["prompt"].split()) + 1))})
        elif not request.startswith("POST /v1/"):  # /metrics: a server without cache counters
            self.wfile.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
        else:
            with self.server.lock:
                self.server.calls += 1
                stall = self.server.calls >= self.server.stall_from
            n = body["max_tokens"]
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n")
            events = [{"choices": [{"text": f" t{i}", "index": 0}]} for i in range(n)]
            events.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 8, "completion_tokens": n}})
            lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
            for i, e in enumerate(lines):
                if stall and i == 1:
                    self.wfile.flush()
                    self.server.stop.wait()  # the stream stays open and silent
                    return
                self.wfile.write(f"{len(e.encode()):x}\r\n{e}\r\n".encode())
            self.wfile.write(b"0\r\n\r\n")

    def _json(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: " + str(len(data)).encode()
                         + b"\r\n\r\n" + data)


_CALLS: dict[str, Any] = {}  # url -> completion calls the stub server has seen


def _serve(stall_from: int, stall_models: bool = False) -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _StallingHandler)
    server.daemon_threads = True
    server.stall_from, server.stall_models = stall_from, stall_models
    server.calls, server.lock, server.stop = 0, threading.Lock(), threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    _CALLS[url] = lambda: server.calls
    yield url
    server.stop.set()
    server.shutdown()
    server.server_close()


@pytest.fixture()
def stalling_server() -> Iterator[str]:
    # Completion calls 1 and 2 are the token-id probe and the warm-up; the run's second
    # request (call 4) stalls.
    yield from _serve(stall_from=4)


@pytest.fixture()
def silent_server() -> Iterator[str]:
    yield from _serve(stall_from=1, stall_models=True)


def _bounded(fn: Any, limit: float) -> tuple[Any, float]:
    """fn() in a daemon thread: its result (or exception) and seconds taken; fails the test if
    it does not return within `limit` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except Exception as e:
            box["err"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"still running after {limit} s: the client waits without bound"
    if "err" in box:
        raise box["err"]
    return box["out"], time.monotonic() - t0


def test_stalled_stream_is_cut_at_the_hard_deadline(stalling_server: str, capsys) -> None:
    load = LoadSpec(base_url=stalling_server, concurrency=1, num_requests=None, duration=1.0,
                    grace=1.0, heartbeat=0.4, progress=False)
    res, took = _bounded(lambda: run_serve_bench(load, WorkloadSpec("random", "8", "3"), {},
                                                 print_table=False), 30.0)
    assert took < 15.0
    s = res["summary"]
    assert (s["completed"], s["failed"], res["cut_requests"]) == (1, 1, 1)
    assert 2.0 <= s["duration_s"] < 4.0
    assert s["errors"] == [CUT]
    ok, cut = res["requests"]
    assert ok["success"] and ok["output_len"] == 3
    assert not cut["success"] and cut["error"] == CUT and cut["e2e"] >= 1.0
    assert "1 in flight (past the duration)" in capsys.readouterr().out


def test_unanswered_setup_is_one_sentence(silent_server: str) -> None:
    load = LoadSpec(base_url=silent_server, num_requests=2, setup_timeout=1.0, progress=False)
    with pytest.raises(ValueError, match="no answer to the set-up requests"):
        _bounded(lambda: run_serve_bench(load, WorkloadSpec(), {}, print_table=False), 30.0)


def test_bad_grace_is_one_sentence() -> None:
    load = LoadSpec(duration=1.0, grace=-1.0)
    with pytest.raises(ValueError, match="grace must be"):
        run_serve_bench(load, WorkloadSpec(), {}, print_table=False)


def test_warm_up_is_as_wide_as_the_run() -> None:
    """Each warm-up round sends `concurrency` requests (the server sees the run's batch shapes
    before the clock starts); they are not part of the results."""
    for url in _serve(stall_from=10**6):
        load = LoadSpec(base_url=url, concurrency=3, num_requests=4, warmup=2, progress=False)
        res, _ = _bounded(lambda load=load: run_serve_bench(
            load, WorkloadSpec("random", "8", "2"), {}, print_table=False), 30.0)
        assert res["summary"]["completed"] == 4 and len(res["requests"]) == 4
        server_calls = 1 + 2 * 3 + 4  # token-id probe, two rounds of three, the run
        assert _CALLS[url]() == server_calls
