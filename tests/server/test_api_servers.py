"""`skyline serve --api-server-count 2`: two API processes in front of one engine core (default
model, float32): concurrent requests through the openai client give offline's greedy text and
land on both processes, a disconnect frees its KV blocks, hostile traffic gets only 4xx, a
killed engine core or API process is replaced, SIGTERM stops every process. One server for the
module (each costs seconds)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import time

import openai
import pytest

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
TIMEOUT = 120.0
LONG = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(server_factory):
    s = server_factory("--api-server-count", "2", "--max-model-len", str(MAX_MODEL_LEN),
                       "--dtype", "float32")
    # /health answered from the first API process up; the banner comes once both are
    deadline = time.monotonic() + 60
    while "2 API processes: pids" not in s.log():
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.2)
    return s


def _pids(server) -> tuple[int, list[int]]:
    """The engine core's pid and the API processes' (as the banner printed them)."""
    m = re.search(r"engine core: pid (\d+); 2 API processes: pids (\d+), (\d+)", server.log())
    assert m is not None, server.log()
    return int(m.group(1)), [int(m.group(2)), int(m.group(3))]


def _per_process(server) -> dict[str, float]:
    """skyline:api_server_requests_total by API process index (summed over both processes)."""
    _, _, body = server.request("GET", "/metrics", timeout=30)
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'skyline:api_server_requests_total\{api_server="(\d+)"[^}]*\} (\S+)', body.decode())}


def test_concurrent_requests_match_offline_on_both_processes(server, model):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(24)]

    async def one(c: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
        if not stream:
            r = await c.completions.create(model=model, prompt=prompt, max_tokens=8,
                                           temperature=0)
            return r.choices[0].text
        s = await c.completions.create(model=model, prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in s if ch.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused",
                                      timeout=TIMEOUT, max_retries=0) as c:
            return await asyncio.wait_for(asyncio.gather(
                *(one(c, p, i % 3 != 0) for i, p in enumerate(prompts))), TIMEOUT)

    served = asyncio.run(main())
    from skyline import LLM, SamplingParams

    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory="256MiB", dtype="float32")
    offline = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert served == [o.outputs[0].text for o in offline]
    # The kernel spreads new connections over the processes' sockets: a few more
    # requests, each on a new connection, until both have taken some.
    for _ in range(40):
        counts = _per_process(server)
        if counts.get("0", 0) > 0 and counts.get("1", 0) > 0:
            break
        status, _, _ = server.request("POST", "/v1/completions",
                                      {"prompt": "Hi", "max_tokens": 1})
        assert status == 200
    assert counts.get("0", 0) > 0 and counts.get("1", 0) > 0, counts
    # /health, /v1/models and /metrics answer from every process
    for _ in range(8):
        assert server.request("GET", "/health")[0] == 200
        status, _, body = server.request("GET", "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == model
        assert "skyline:num_requests_running" in server.metrics()


def test_disconnects_free_their_blocks(server, model):
    conns = []
    for _ in range(6):  # on new connections: both processes take some
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", body=json.dumps({**LONG, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conns.append(conn)
    m = server.metrics()
    assert m["skyline:num_requests_running"] == 6 and m["skyline:kv_cache_used_blocks"] > 0
    for conn in conns:  # the clients go away mid-stream
        conn.sock.close()
        conn.close()
    m = server.wait_idle(20)
    assert m["skyline:num_requests_running"] == 0 and m["skyline:kv_cache_used_blocks"] == 0


def test_hostile_traffic_leaves_both_processes_up(server):
    """bench/hostile.py's smoke mix (fuzzed bodies, overflowing values, a big body, a burst,
    malformed HTTP, clients leaving mid-stream) spread over both API processes: only 4xx, no
    leaked block, /health answered throughout."""
    server.hostile_smoke()
    assert len(_per_process(server)) == 2  # both took requests


def test_a_killed_engine_core_fails_requests_cleanly_and_comes_back(server):
    # each request with the single API process's error body
    server.cut_under_load(LONG, 6, 6, lambda: os.kill(server.engine_pid(), signal.SIGKILL),
                          "restarting")
    deadline = time.monotonic() + 90
    while server.request("GET", "/health", timeout=10)[0] != 200:
        assert time.monotonic() < deadline, "the engine never came back"
        time.sleep(0.2)
    for _ in range(6):  # both processes serve again (new connections, spread over them)
        status, _, raw = server.request("POST", "/v1/completions",
                                        {"prompt": "hi", "max_tokens": 3})
        assert status == 200, raw
    m = server.wait_idle(20)
    assert m["skyline:engine_restarts_total"] == 1 and m["skyline:kv_cache_used_blocks"] == 0


def test_a_killed_api_process_is_replaced(server):
    _, api = _pids(server)
    os.kill(api[1], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while "API process 1 started again" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    for _ in range(6):
        status, _, raw = server.request("POST", "/v1/completions",
                                        {"prompt": "hi", "max_tokens": 3})
        assert status == 200, raw


def test_sigterm_stops_every_process(server):
    engine = server.engine_pid()
    api = [int(p) for p in re.findall(r"API process \d+ started again \(pid (\d+)\)",
                                      server.log())] + _pids(server)[1][:1]
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert "skyline: server stopped" in server.log()
    deadline = time.monotonic() + 15
    for pid in [engine, *api]:
        while os.path.exists(f"/proc/{pid}"):
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            assert time.monotonic() < deadline, f"process {pid} outlived the server"
            time.sleep(0.2)
