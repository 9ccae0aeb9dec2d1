"""The engine core killed under load: requests in flight end with clean errors (an SSE error event
and [DONE] for streams, a 503 otherwise), /health is 503 only while a new engine starts, and the
server serves again with nothing leaked and the restart counted. Then SIGTERM with requests that
outlive the drain timeout: each ends with an error of its own."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time

import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", "512", "--max-num-seqs", "4",
                          "--shutdown-timeout", "1")


def _engine_pid(server) -> int:
    return int(re.findall(r"engine core(?:: pid| restarted \(pid) (\d+)", server.log())[-1])


def _post(server, body: dict, out: list, timeout: float = 60) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.append((resp.status, resp.read()))
    finally:
        conn.close()


def _check_cut(results: list, word: str) -> None:
    for status, body in results:
        if status == 200:  # a stream: an error event, then [DONE]
            events = [e for e in body.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]", events[-3:]
            err = json.loads(events[-2][len("data: "):])["error"]
            assert err["code"] == 503 and word in err["message"], err
        else:
            assert status == 503, body
            assert word in json.loads(body)["error"]["message"]


def test_kill_the_engine_mid_load_and_recover(server):
    results: list = []
    threads = [threading.Thread(target=_post, args=(server, {**LONG, "stream": i % 2 == 0},
                                                    results)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["skyline:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "nothing started running"
        time.sleep(0.1)
    killed_at = time.monotonic()
    os.kill(_engine_pid(server), signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(results) == 6
    _check_cut(results, "restarting")
    # /health: 503 while the new engine starts, then 200 by itself
    saw_503 = False
    while True:
        status = server.request("GET", "/health", timeout=10)[0]
        saw_503 |= status == 503
        if status == 200:
            break
        assert status == 503
        assert time.monotonic() - killed_at < 90, "the engine never came back"
        time.sleep(0.1)
    assert saw_503
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 200, raw
    m = server.wait_idle(20)
    assert m["skyline:engine_restarts_total"] == 1
    assert m["skyline:kv_cache_used_blocks"] == 0
    log = server.log()
    assert "restarting the engine core in" in log and "engine core restarted" in log


def test_sigterm_cuts_what_outlives_the_drain_with_errors(server):
    results: list = []
    threads = [threading.Thread(target=_post, args=(server, {**LONG, "stream": i % 2 == 0},
                                                    results)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["skyline:num_requests_running"] < 2:
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.1)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert len(results) == 2
    _check_cut(results, "shut down")
    server.proc.wait(30)
