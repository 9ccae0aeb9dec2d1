"""A hostile client against one real `skyline serve` (default model, CPU): values that overflow
the engine's types, strings that are not Unicode, and the server still serving afterwards with
nothing leaked."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", "512")


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


@pytest.mark.parametrize("field,value", [
    *((f, v) for f in ("top_k", "min_tokens", "max_tokens", "logprobs", "n")
      for v in (2**63, 2**64, 2**64 + 1)),
    ("seed", 2**64), ("seed", -(2**63) - 1),
])
def test_integers_the_engine_cannot_hold_are_400(server, field, value):
    _error(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, field: value})
    _error(server, CHAT, {"messages": _ask("hi"), "max_tokens": 2, field: value})


def test_stop_token_ids_out_of_range_are_400(server):
    _error(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2**64]})


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


def test_nothing_leaked_and_still_serving(server):
    m = server.wait_idle(20)
    assert m["skyline:num_requests_running"] == 0 and m["skyline:kv_cache_usage_perc"] == 0
    assert "Traceback" not in server.log()
    _status(server, CHAT, {"messages": _ask("hi"), "max_tokens": 2}, 200)
