"""A hostile client against one real `skyline serve` (default model, CPU, small limits): values
that overflow the engine's types, strings that are not Unicode, requests over the limits, client
templates, bodies that never arrive, malformed HTTP, random bodies (seeded) and schemathesis on
the OpenAPI schema, a burst past the waiting queue, /health latency while 10 MB bodies are
processed, and the bench script's smoke mode; then the server still serves, with nothing
leaked. Last, the engine core killed under load (clean errors, then a restart by itself) and a
SIGTERM whose cut requests each end with an error."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_NUM_SEQS, MAX_WAITING = 4, 8


def _load_bench():
    spec = importlib.util.spec_from_file_location("hostile", os.path.join(ROOT, "bench",
                                                                          "hostile.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


hostile = _load_bench()


# The operator's template (--chat-template): SmolLM2's, with its own default system prompt.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are the operator assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return server_factory(
        "--chat-template", str(template),
        "--max-model-len", "128", "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-waiting", str(MAX_WAITING), "--body-timeout", "2", "--prepare-timeout", "5",
        "--max-stop", "4", "--max-stop-chars", "50", "--max-n", "16", "--max-tools", "2",
        "--max-schema-bytes", "2000", "--max-prompt-chars", "200000", "--max-logprobs", "5",
        # a drain far shorter than LONG's 100 tokens (two streams make ~100-200 tok/s each
        # here): the SIGTERM test's requests outlive it however fast the machine runs them
        "--shutdown-timeout", "0.2")


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _status(server, path: str, body, status: int) -> dict:
    code, _, raw = server.request("POST", path, body, timeout=60)
    assert code == status, raw
    return json.loads(raw)


def _error(server, path: str, body, status: int = 400) -> str:
    err = _status(server, path, body, status)["error"]
    assert err["message"] and "Traceback" not in err["message"]
    return err["message"]


# ------------------------------------------------------------------ values and strings


@pytest.mark.parametrize("field,value", [
    *((f, v) for f in ("top_k", "min_tokens", "max_tokens", "logprobs", "n")
      for v in (2**63, 2**64, 2**64 + 1)),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("stop_token_ids", [2**64]),
    ("temperature", float("nan")), ("repetition_penalty", float("inf")),
])
def test_values_the_engine_cannot_hold_are_400(server, field, value):
    _error(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, field: value})
    _error(server, CHAT, {"messages": _ask("hi"), "max_tokens": 2, field: value})


def test_child_seeds_wrap_and_stay_reproducible(server):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "n": 3, "seed": 2**64 - 1,
            "temperature": 1.0}
    a = _status(server, COMPLETIONS, body, 200)
    b = _status(server, COMPLETIONS, body, 200)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": _ask("a\ud800b"), "max_tokens": 2}),
    (COMPLETIONS, {"prompt": "a\ud800b", "max_tokens": 2}),
    (COMPLETIONS, {"prompt": ["ok", "a\udc00"], "max_tokens": 2}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "stop": ["\ud800"]}),
    ("/tokenize", {"prompt": "a\ud800b"}),
    ("/tokenize", {"messages": _ask("a\ud800b")}),
])
def test_lone_surrogates_are_400(server, path, body):
    assert "Unicode" in _error(server, path, body)


def test_bytes_that_are_not_utf8_are_400(server):
    code, _, raw = server.request("POST", COMPLETIONS, b'{"prompt": "\xff\xfe"}')
    assert code == 400 and "Unicode" in json.loads(raw)["error"]["message"]


# ------------------------------------------------------------------ limits and templates


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["x" * 51]}, "stop"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)],
      "tool_choice": "none"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * 3000}}}}, "response_format"),
    ({"messages": _ask("x" * 200_001)}, "messages"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"bos_token": "X"}}, "chat_template_kwargs"),
])
def test_requests_over_the_limits_are_400(server, body, param):
    err = _status(server, CHAT, {"messages": _ask("hi"), "max_tokens": 2, **body}, 400)["error"]
    assert err["param"] == param, err


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": _ask("hi"), "n": MAX_WAITING + 1}),
    # 3 prompts x n=3: 9 sequences at once
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 3}),
])
def test_a_request_that_can_never_be_queued_is_400_not_429(server, path, body):
    err = _status(server, path, {**body, "max_tokens": 2}, 400)["error"]
    assert "queues at most" in err["message"]


def test_the_operators_template_renders_the_chat(server):
    tokens = _status(server, "/tokenize", {"messages": _ask("hi")}, 200)["tokens"]
    text = _status(server, "/detokenize", {"tokens": tokens}, 200)["prompt"]
    assert "You are the operator assistant." in text and "SmolLM" not in text


def test_template_kwargs_are_data(server):
    r = _status(server, CHAT, {"messages": _ask("hi"), "max_tokens": 2,
                               "chat_template_kwargs": {"enable_thinking": False,
                                                        "x": [1, {"y": "z"}]}}, 200)
    assert r["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ HTTP


def _raw(server, data: bytes) -> tuple[bytes, bytes]:
    """Send raw bytes; the reply's head and body (the server closes the connection)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def test_a_body_that_never_arrives_is_408(server):
    t = time.monotonic()
    head, body = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                              b"application/json\r\nContent-Length: 100000\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert "did not arrive" in json.loads(body)["error"]["message"]
    assert time.monotonic() - t < 15


@pytest.mark.parametrize("data", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GARBAGE\r\n\r\n",
])
def test_malformed_http_is_an_openai_shaped_400(server, data):
    head, body = _raw(server, data)
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_head_health_and_forged_log_lines(server):
    assert server.request("HEAD", "/health")[0] == 200
    _status(server, CHAT, {"messages": _ask("hi"), "max_tokens": 1,
                           "user": "eve\nINFO skyline.server: forged"}, 200)
    assert "user=eve\\nINFO skyline.server: forged" in server.log()
    assert "\nINFO skyline.server: forged" not in server.log()


# ------------------------------------------------------------------ fuzzing


def test_fuzz_random_bodies_with_a_fixed_seed(server):
    rng = random.Random(24)
    bodies = [hostile.fuzz_body(rng) for _ in range(64)]
    target = hostile.Target("127.0.0.1", server.port)

    def send(item):
        return target.request("POST", item[0], item[1], timeout=90)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(send, bodies))
    assert set(statuses) <= {200, 400, 404, 413, 429}, statuses
    assert statuses.count(200) >= 5 and statuses.count(400) >= 20


def test_schemathesis_on_the_openapi_schema(server):
    """Bodies schemathesis derives from /openapi.json (valid ones, mostly), a few per route:
    none may be a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{server.port}/openapi.json")
    failures: list = []

    def short(case):
        # generation stays short, so that the test's time is parsing and validation (random
        # values of these fields are the fuzz test's)
        if isinstance(case.body, dict):
            case.body["max_tokens"], case.body["n"] = 2, 1
            case.body.pop("max_completion_tokens", None)
        return case

    def check_operation(op):
        @settings(max_examples=6, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy().map(short))
        def check(case):
            resp = case.call(timeout=90)
            if resp.status_code >= 500:
                failures.append((op.path, case.body, resp.status_code, resp.text[:200]))

        check()

    ops = [r.ok() for r in schema.get_all_operations()]
    for op in ops:
        if op.method.upper() == "POST":
            check_operation(op)
    assert {op.path for op in ops} >= {CHAT, COMPLETIONS, "/tokenize", "/detokenize"}
    assert not failures, failures


# ------------------------------------------------------------------ load


def test_burst_past_the_waiting_queue_gets_429s_and_no_hang(server):
    target = hostile.Target("127.0.0.1", server.port)
    body = json.dumps({"prompt": "Write a story.", "max_tokens": 24, "ignore_eos": True})
    t = time.monotonic()
    results: list = []

    def one(_):
        status, raw = target.request("POST", COMPLETIONS, body.encode(), timeout=90)
        results.append((status, raw))

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        list(pool.map(one, range(40)))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 40 - MAX_NUM_SEQS - MAX_WAITING - 4
    assert statuses.count(200) >= MAX_NUM_SEQS
    assert time.monotonic() - t < 90
    err = json.loads(next(raw for s, raw in results if s == 429))["error"]
    assert err["type"] == "rate_limit_error" and "retry later" in err["message"]


def test_health_does_not_stall_behind_10_mb_bodies(server):
    target = hostile.Target("127.0.0.1", server.port)
    bodies = hostile.big_bodies(10 << 20)
    latencies: list[float] = []
    statuses: list = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            t = time.perf_counter()
            assert target.request("GET", "/health", timeout=30)[0] == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    t = time.monotonic()
    try:
        for path, body in bodies:
            statuses.append(target.request("POST", path, body, timeout=60)[0])
    finally:
        done.set()
        prober.join(30)
    elapsed = time.monotonic() - t
    assert statuses == [400, 400, 400], statuses  # over --max-prompt-chars, each
    assert elapsed < 30 and len(latencies) >= 10
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    print(f"/health under 10 MB bodies: {len(latencies)} probes over {elapsed:.1f}s, median "
          f"{statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max "
          f"{max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 1.0  # it once stalled 30 s behind one such body


def test_bench_smoke_mode(server):
    assert server.hostile_smoke()["requests_sent"] > 30


def test_nothing_leaked_and_still_serving(server):
    m = server.wait_idle(30)
    assert m["skyline:num_requests_running"] == 0 and m["skyline:kv_cache_used_blocks"] == 0
    assert m["skyline:engine_restarts_total"] == 0
    log = server.log()
    assert "internal error" not in log and "Traceback" not in log
    _status(server, CHAT, {"messages": _ask("hi"), "max_tokens": 2}, 200)


# ------------------------------------------------------------------ the engine killed, SIGTERM
# (last: they restart the engine, then stop the server)


LONG = {"prompt": "Tell me a long story.", "max_tokens": 100, "ignore_eos": True}


def test_kill_the_engine_mid_load_and_recover(server):
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(server.engine_pid(), signal.SIGKILL)

    server.cut_under_load(LONG, 6, 1, kill, "restarting")
    # /health: 503 while the new engine starts, then 200 by itself
    saw_503 = False
    while True:
        status = server.request("GET", "/health", timeout=10)[0]
        saw_503 |= status == 503
        if status == 200:
            break
        assert status == 503
        assert time.monotonic() - killed_at[0] < 90, "the engine never came back"
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
    server.cut_under_load(LONG, 2, 2, lambda: server.proc.send_signal(signal.SIGTERM),
                          "shut down", join_timeout=30)
    server.proc.wait(30)
