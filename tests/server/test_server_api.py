"""End to end through the official openai client against a real `skyline serve` (default model,
CPU): chat, completions, streaming, n, logprobs, stop, seeds, json_schema, 32 concurrent
streams against offline greedy, disconnects, and every error path."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import openai
import pytest

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
MAX_BODY = 200_000
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def server(server_factory):
    # float32: greedy tokens are batch-invariant there (the CPU plan's bfloat16 products differ
    # with the rows in a step, so concurrent streams could flip a near-tie against offline)
    return server_factory("--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
                          "--max-request-bytes", str(MAX_BODY))


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run_concurrently(server, *calls):
    """Run calls (each: AsyncOpenAI client -> awaitable) at once, so the engine batches them."""

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused",
                                      timeout=TIMEOUT, max_retries=0) as c:
            return await asyncio.wait_for(asyncio.gather(*(f(c) for f in calls)), TIMEOUT)

    return asyncio.run(main())


def test_models(client, model, server):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra.get("max_model_len") == MAX_MODEL_LEN
    # the start-up banner names what a decode step runs on the CPU: float32 is the exact path
    # (oneDNN's packed products, in the C++ step where skyline's CPU operations build)
    from skyline.ops import cpu_ext

    step = "the C++ decode step" if cpu_ext.available() else "planned products called from Python"
    assert f"CPU decode kernels: Linears 120 onednn, LM head onednn; {step}" in server.log()


def test_chat(client, model):
    r = client.chat.completions.create(model=model, messages=_ask("What is the capital of "
                                       "France?"), max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_text_ids_and_batch(client, model, server):
    text = "The capital of France is"
    status, _, body = server.request("POST", "/tokenize", {"prompt": text})
    assert status == 200
    ids = json.loads(body)["tokens"]
    kw = dict(model=model, max_tokens=6, temperature=0)
    r, r2, batch = run_concurrently(
        server,
        lambda c: c.completions.create(prompt=text, **kw),
        lambda c: c.completions.create(prompt=ids, **kw),
        lambda c: c.completions.create(prompt=[text, "1, 2, 3,"], **kw),
    )
    assert r.choices[0].text and r.usage.completion_tokens == 6
    assert r.choices[0].finish_reason == "length"
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens == len(ids)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == r.choices[0].text
    assert batch.usage.completion_tokens == 12


def test_streaming_matches_non_streaming(server, model):
    kw = dict(model=model, messages=_ask("Name three colors."), max_tokens=8, temperature=0)

    async def streamed(c):
        stream = await c.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True})
        return [chunk async for chunk in stream]

    full, chunks = run_concurrently(server, lambda c: c.chat.completions.create(**kw), streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices(server, model):
    async def streamed(c):
        stream = await c.chat.completions.create(model=model, messages=_ask("Hi"), n=2,
                                                 max_tokens=4, temperature=1.0, seed=3,
                                                 stream=True)
        return [chunk async for chunk in stream]

    r, chunks = run_concurrently(
        server,
        lambda c: c.completions.create(model=model, prompt="Once upon a time", n=3,
                                       max_tokens=5, temperature=1.0, seed=7),
        streamed,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    finishes = {0: [], 1: []}
    for chunk in chunks:
        for c in chunk.choices:
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert all(len(f) == 1 for f in finishes.values()), finishes


def test_logprobs(server, model):
    r, c = run_concurrently(
        server,
        lambda c: c.chat.completions.create(model=model, messages=_ask("Say hello."),
                                            max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=3),
        lambda c: c.completions.create(model=model, prompt="The sky is", max_tokens=4,
                                       temperature=0, logprobs=2),
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the top one
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text
    assert all(len(t) >= 1 for t in lp.top_logprobs)


def test_stop(client, model):
    prompt = "Write the numbers from one to ten in words:"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    text = full.choices[0].text
    words = [w for w in text.split() if len(w) >= 3]
    assert words, text
    stop = words[min(1, len(words) - 1)]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproducible(server, model):
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=6, temperature=1.0)
    texts = run_concurrently(server, *(
        lambda c, s=s: c.completions.create(**kw, seed=s) for s in (1234, 1234, 1, 2, 3)))
    texts = [t.choices[0].text for t in texts]
    assert texts[0] == texts[1]  # the same seed gives the same draw, even batched
    assert len(set(texts)) > 1  # and seeds do change it


def test_json_schema(server, model):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }
    r, r2 = run_concurrently(
        server,
        lambda c: c.chat.completions.create(
            model=model, messages=_ask("Describe a person as JSON with a name and an age."),
            max_tokens=40, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": schema}}),
        lambda c: c.chat.completions.create(
            model=model, messages=_ask("Give a JSON object with a key 'ok' set to true."),
            max_tokens=20, temperature=0, response_format={"type": "json_object"}),
    )
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age"}
    assert isinstance(data["name"], str) and len(data["name"]) <= 12
    assert isinstance(data["age"], int) and 0 <= data["age"] <= 120
    content = r2.choices[0].message.content
    assert content.startswith("{")
    if r2.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_concurrent_streams_match_offline(server, model):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(32)]

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    served = run_concurrently(server, *(lambda c, p=p: one(c, p) for p in prompts))
    from skyline import LLM, SamplingParams

    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory="256MiB", dtype="float32")
    offline = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert served == [o.outputs[0].text for o in offline]


def _open_stream(server, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn


def test_disconnect_frees_blocks(server, model):
    long = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}
    conn = _open_stream(server, {**long, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the request is running
    m = server.metrics()
    assert m["skyline:num_requests_running"] == 1 and m["skyline:kv_cache_usage_perc"] > 0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    m = server.wait_idle(15)
    assert m["skyline:num_requests_running"] == 0 and m["skyline:kv_cache_usage_perc"] == 0
    # A non-streaming request whose client gives up is aborted too.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1.5)
    conn.request("POST", "/v1/completions", body=json.dumps(long),
                 headers={"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    m = server.wait_idle(15)
    assert m["skyline:num_requests_running"] == 0 and m["skyline:kv_cache_usage_perc"] == 0
    assert server.log().count("aborted") >= 2


def _error(server, body, path="/v1/chat/completions", method="POST", status=400) -> dict:
    code, headers, raw = server.request(method, path, body)
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in err["message"]
    return err


def test_errors(server, client, model):
    chat = {"model": model, "messages": _ask("hi"), "max_tokens": 2}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=_ask("hi"), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model, prompt="hello " * (MAX_MODEL_LEN + 10),
                                  max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert _error(server, {**chat, "temperature": 3})["param"] == "temperature"
    assert _error(server, {**chat, "n": 0})["param"] == "n"
    _error(server, {**chat, "top_p": 0})
    _error(server, {**chat, "max_tokens": 0})
    _error(server, {**chat, "stop": 5})
    assert _error(server, {**chat, "logit_bias": {"1": 500}})["param"].startswith("logit_bias")
    _error(server, {**chat, "messages": []})
    _error(server, {**chat, "messages": [{"role": "wizard", "content": "x"}]})
    _error(server, {**chat, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    _error(server, {**chat, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}})
    _error(server, {**chat, "response_format": {"type": "xml"}})
    _error(server, {"model": model})
    _error(server, b"{not json")
    _error(server, b"[1, 2]")
    _error(server, None)
    _error(server, {"model": model, "prompt": [1, 2, 10**9]}, "/v1/completions")
    _error(server, {"model": model, "prompt": []}, "/v1/completions")
    _error(server, {"model": model, "prompt": "x", "best_of": 3}, "/v1/completions")
    _error(server, {"tokens": [-1]}, "/detokenize")
    err = _error(server, {**chat, "model": "nope"}, status=404)
    assert err["code"] == "model_not_found"
    _error(server, None, "/v1/nothing-here", status=404)
    _error(server, None, "/v1/chat/completions", method="GET", status=405)
    _error(server, {**chat, "messages": _ask("x" * MAX_BODY)}, status=413)
    # The server survived all of it.
    status, _, _ = server.request("GET", "/health")
    assert status == 200
    r = client.chat.completions.create(model=model, messages=_ask("hi"), max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_tokenize_detokenize(server, model):
    status, _, body = server.request("POST", "/tokenize", {"model": model, "prompt": "Hello"})
    ids = json.loads(body)["tokens"]
    assert status == 200 and ids
    status, _, body = server.request("POST", "/detokenize", {"model": model, "tokens": ids})
    assert status == 200 and json.loads(body)["prompt"] == "Hello"
    status, _, body = server.request("POST", "/tokenize", {"messages": _ask("Hello")})
    data = json.loads(body)
    assert status == 200 and data["count"] > len(ids) and data["max_model_len"] == MAX_MODEL_LEN


def test_metrics(server):
    time.sleep(0.2)
    m = server.metrics()
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):
        assert m[f"skyline:{name}"] > 0, name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate"):
        assert f"skyline:{name}" in m
    assert "chatcmpl-" in server.log() and "cmpl-" in server.log()


def test_engine_exits_with_the_server(server):
    import os
    import re
    import signal

    pid = int(re.search(r"engine core: pid (\d+)", server.log()).group(1))
    assert os.path.exists(f"/proc/{pid}")
    server.proc.send_signal(signal.SIGKILL)  # no chance to clean up
    server.proc.wait(10)
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{pid}"):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                break
        assert time.monotonic() < deadline, "the engine outlived its server"
        time.sleep(0.2)
