"""A small server (one running request, one waiting, an API key): 401 without the key, 429 with
Retry-After when the waiting queue is full, and a SIGTERM that lets in-flight requests finish."""

from __future__ import annotations

import http.client
import json
import signal
import time

import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting", "1",
                          "--api-key", KEY, "--shutdown-timeout", "60",
                          "--served-model-name", "smol")


def _stream(server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({"stream": True, **body}),
                 headers={"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_api_key(server):
    body = {"model": "smol", "prompt": "hi", "max_tokens": 1}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                    {"Authorization": KEY}):
        status, hdrs, raw = server.request("POST", "/v1/completions", body, headers)
        assert status == 401
        assert json.loads(raw)["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0,
                      timeout=30).models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    assert client.models.list().data[0].id == "smol"
    r = client.completions.create(model="smol", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    no_key = {"Authorization": ""}
    assert server.request("GET", "/health", headers=no_key)[0] == 200  # probes need no key
    for path in ("/metrics", "/openapi.json", "/v1/models"):
        assert server.request("GET", path, headers=no_key)[0] == 401, path
        assert server.request("GET", path)[0] == 200, path


def test_queue_full_gives_429(server):
    long = {"model": "smol", "prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True}
    running, resp_a = _stream(server, long)
    assert resp_a.readline().startswith(b"data: ")
    waiting, _ = _stream(server, long)
    deadline = time.monotonic() + 30
    while server.metrics()["skyline:num_requests_waiting"] < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.1)
    status, headers, raw = server.request("POST", "/v1/completions",
                                          {"model": "smol", "prompt": "hi", "max_tokens": 1},
                                          AUTH)
    assert status == 429
    assert int(headers["retry-after"]) >= 1
    assert "retry later" in json.loads(raw)["error"]["message"]
    for conn in (running, waiting):
        conn.sock.close()
        conn.close()
    m = server.wait_idle(20)
    assert m["skyline:num_requests_running"] == 0 and m["skyline:kv_cache_usage_perc"] == 0


def test_sigterm_finishes_in_flight_requests(server):
    conn, resp = _stream(server, {"model": "smol", "prompt": "Count to twenty:",
                                  "max_tokens": 12, "ignore_eos": True, "temperature": 0})
    first = resp.readline()
    assert first.startswith(b"data: ")
    server.proc.send_signal(signal.SIGTERM)
    rest = resp.read().decode()  # the stream runs to its end after SIGTERM
    conn.close()
    events = [json.loads(line[6:]) for line in [first.decode(), *rest.splitlines()]
              if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert rest.rstrip().endswith("data: [DONE]")
    # uvicorn re-raises the SIGTERM after its graceful shutdown (and ours): exit by signal.
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    assert "server stopped" in server.log()
