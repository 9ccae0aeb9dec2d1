"""`skyline serve --replicas 2` on the default model, through the `openai` client: the router's
answers are the replicas' (greedy tokens identical to a replica asked directly, streamed or
not), a shared prefix stays on the replica that caches it (its KV events feed the router's
index, and the replica's usage confirms the hits), and a replica killed mid-stream ends that
stream with an error event while the next requests complete on the other one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.conftest import free_port

STARTUP_TIMEOUT = 240.0
SYSTEM = ("You are a careful assistant for a museum of maritime history. Answer questions about "
          "ships, harbours, navigation and the lives of sailors in plain words, and say so "
          "when you do not know. ")


def get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics(base: str) -> dict[str, float]:
    _, body = get(f"{base}/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Fleet:
    def __init__(self, tmp: str, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, "fleet.log")
        cmd = [sys.executable, "-m", "skyline.cli", "serve", "--replicas", "2", "--port",
               str(self.port), "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
               "--shutdown-timeout", "5", *flags]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def replicas(self) -> list[str]:
        return sorted({m.group(1) for k in metrics(self.base)
                       if (m := re.search(r'replica="([^"]+)"', k))})

    def healthy(self) -> dict[str, bool]:
        m = metrics(self.base)
        return {r: m.get(f'skyline_router:replica_healthy{{replica="{r}"}}') == 1.0
                for r in self.replicas()}

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the fleet exited during start-up:\n{self.log()}")
            try:
                h = self.healthy()
                ready = metrics(self.base).get("skyline_router:prompt_hashing_ready") == 1.0
                if len(h) == 2 and all(h.values()) and ready:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"the fleet did not start in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(str(tmp_path_factory.mktemp("fleet")))
    try:
        f.wait_ready()
        yield f
    finally:
        f.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def chat(c: openai.OpenAI, question: str, **kw: Any) -> Any:
    return c.chat.completions.with_raw_response.create(
        model=c.models.list().data[0].id, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **kw)


@pytest.mark.slow
def test_router_answers_are_the_replicas(fleet: Fleet):
    via = client(fleet.base)
    raw = chat(via, "What is a harbour?")
    where = raw.headers["x-skyline-replica"]
    direct = chat(client(f"http://{where}"), "What is a harbour?").parse()
    assert raw.parse().choices[0].message.content == direct.choices[0].message.content
    stream = via.completions.create(model=direct.model, prompt="The lighthouse keeper",
                                    max_tokens=10, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    whole = client(f"http://{where}").completions.create(
        model=direct.model, prompt="The lighthouse keeper", max_tokens=10, temperature=0)
    assert streamed == whole.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # the replica's 400, unchanged
        via.completions.create(model=direct.model, prompt="x", max_tokens=10**6)
    assert "context length" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        via.completions.create(model="no-such-model", prompt="x", max_tokens=1)


@pytest.mark.slow
def test_shared_prefix_stays_where_it_is_cached(fleet: Fleet):
    via = client(fleet.base)
    before = metrics(fleet.base)
    served, cached = set(), []
    for i in range(4):
        raw = chat(via, f"Question {i}: how did sailors find their way at night?")
        served.add(raw.headers["x-skyline-replica"])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(served) == 1, served
    assert all(c >= 32 for c in cached[1:]), cached  # the system prompt, from the cache
    after = metrics(fleet.base)
    (r,) = served
    predicted = after[f'skyline_router:predicted_hit_tokens_total{{replica="{r}"}}'] - before.get(
        f'skyline_router:predicted_hit_tokens_total{{replica="{r}"}}', 0)
    assert predicted == sum(cached), (predicted, cached)  # the index was exact


@pytest.mark.slow
def test_killed_replica_ends_its_stream_and_the_other_serves(fleet: Fleet):
    via = client(fleet.base)
    model = via.models.list().data[0].id
    raw = via.completions.with_raw_response.create(
        model=model, prompt="Tell a long story about a ship.", max_tokens=400, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    victim = raw.headers["x-skyline-replica"]
    _, body = get(f"http://{victim}/fleet")
    stream = raw.parse()
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        for i, _ in enumerate(stream):
            if i == 3:
                os.kill(json.loads(body)["pid"], signal.SIGKILL)
    assert "the replica serving this request failed" in str(e.value)
    assert time.monotonic() - t0 < 60
    for i in range(3):  # the next requests go to the other replica
        raw = chat(via, f"Another question {i}")
        assert raw.http_response.status_code == 200
        assert raw.headers["x-skyline-replica"] != victim
    assert fleet.healthy()[victim] is False
