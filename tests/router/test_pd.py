"""Prefill/decode disaggregation on the CPU with the default model: `skyline serve --replicas
2 --role prefill,decode`. A long prompt is prefilled on one replica and its KV pulled by the
other, which answers: greedy tokens identical to one engine doing both (the prefill replica
asked directly), streamed or not; a short prompt is prefilled where it decodes; a transfer
that fails is recomputed (same answer); with the prefill replica dead, requests still end."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.router.test_fleet import Fleet, get, metrics

STORY = ("The old lighthouse keeper climbed the stairs every evening to light the lamp, and "
         "the ships that passed in the night never knew his name. ") * 6


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str, str]]:
    f = Fleet(str(tmp_path_factory.mktemp("pd")), "--role", "prefill,decode",
              "--pd-min-prompt-tokens", "64")
    try:
        f.wait_ready()
        roles = {r: json.loads(get(f"http://{r}/fleet")[1])["role"] for r in f.replicas()}
        inv = {v: k for k, v in roles.items()}
        yield f, inv["prefill"], inv["decode"]
    finally:
        f.stop()


def post(base: str, path: str, body: dict[str, Any]) -> tuple[dict[str, str], Any]:
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read()
        headers = {k.lower(): v for k, v in r.headers.items()}
    if body.get("stream"):
        events = [json.loads(line[5:]) for line in raw.decode().split("\n\n")
                  if line.startswith("data: {")]
        return headers, "".join(c["text"] for e in events for c in e["choices"])
    return headers, json.loads(raw)


def pd_prefills(base: str) -> float:
    return sum(v for k, v in metrics(base).items() if k.startswith("skyline_router:pd_prefills"))


@pytest.mark.slow
def test_long_prompts_are_disaggregated_with_identical_tokens(pd):
    fleet, prefill, decode = pd
    body = {"prompt": STORY + " Chapter one.", "max_tokens": 12, "temperature": 0}
    before = pd_prefills(fleet.base)
    h, out = post(fleet.base, "/v1/completions", body)
    assert pd_prefills(fleet.base) == before + 1
    assert h["x-skyline-replica"] == decode
    n = out["usage"]["prompt_tokens"]
    # the decode replica had none of it: every full block but the last token's came over
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    _, alone = post(f"http://{prefill}", "/v1/completions", body)
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]
    # another prefix: the decode replica now holds the first one (then it would prefill the
    # few uncached tokens itself)
    stream = {"prompt": "Chapter two. " + STORY, "max_tokens": 12, "temperature": 0,
              "stream": True}
    _, streamed = post(fleet.base, "/v1/completions", stream)
    _, whole = post(f"http://{prefill}", "/v1/completions", {**stream, "stream": False})
    assert streamed == whole["choices"][0]["text"]
    assert pd_prefills(fleet.base) == before + 2
    post(fleet.base, "/v1/completions", {"prompt": "Hello there", "max_tokens": 2})
    assert pd_prefills(fleet.base) == before + 2  # short: prefilled where it decodes


@pytest.mark.slow
def test_failed_transfer_is_recomputed(pd):
    fleet, prefill, decode = pd
    port = json.loads(get(f"http://{prefill}/fleet")[1])["kv_transfer_port"]
    body = {"prompt": "Chapter three. " + STORY, "max_tokens": 12, "temperature": 0}
    t0 = time.monotonic()
    _, out = post(f"http://{decode}", "/v1/completions", {**body, "kv_transfer_params": {
        "transfer_id": "never-sent", "peer": f"tcp://127.0.0.1:{port}"}})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert time.monotonic() - t0 < 60
    _, alone = post(f"http://{prefill}", "/v1/completions", body)
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]


@pytest.mark.slow
def test_dead_prefill_replica_falls_back(pd):
    fleet, prefill, decode = pd
    body = {"prompt": "Chapter four. " + STORY, "max_tokens": 8, "temperature": 0}
    _, before = post(f"http://{prefill}", "/v1/completions", body)
    os.kill(json.loads(get(f"http://{prefill}/fleet")[1])["pid"], signal.SIGKILL)
    h, out = post(fleet.base, "/v1/completions", body)
    assert h["x-skyline-replica"] == decode
    assert out["choices"][0]["text"] == before["choices"][0]["text"]
