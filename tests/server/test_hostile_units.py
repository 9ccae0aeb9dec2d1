"""The server's defences without a model: the guard middleware (500s that keep the connection),
request limits, the chat-template sandbox and log escaping."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from skyline.engine.supervisor import RestartPolicy
from skyline.server.guard import Guard
from skyline.server.lifecycle import escape_controls
from skyline.server.limits import RequestLimits
from skyline.server.parse import (
    INLINE_BODY_BYTES,
    Parsed,
    ParsePool,
    PrepareTimeout,
    Rejected,
    parse,
)


def _app_with_bug() -> FastAPI:
    app = FastAPI()

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    app.add_middleware(Guard, api_key=None, max_body_bytes=1000)
    return app


def test_a_bug_is_an_openai_shaped_500_on_a_kept_connection():
    with TestClient(_app_with_bug(), raise_server_exceptions=False) as client:
        r = client.get("/bug")
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "bug in skyline" in err["message"]
        assert r.headers.get("connection") != "close"
        assert client.get("/ok").json() == {"ok": True}


def test_restart_backoff_doubles_up_to_its_cap():
    p = RestartPolicy(max_restarts=5, backoff_first_s=0.5, backoff_max_s=4.0)
    assert [p.delay(k) for k in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]


def test_log_lines_cannot_be_forged():
    assert escape_controls("bob\nINFO forged\r\x1b[2J\u2028é") == \
        "bob\\nINFO forged\\r\\x1b[2J\\u2028é"


LIMITS = RequestLimits(max_prompt_chars=1000, max_n=4, max_stop=2, max_stop_chars=5,
                       max_tools=1, max_schema_bytes=100).resolved(512)


def _chat(**kw) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **kw}).encode()


@pytest.mark.parametrize("body,param", [
    (_chat(n=5), "n"),
    (_chat(stop=["a", "b", "c"]), "stop"),
    (_chat(stop="abcdef"), "stop"),
    (_chat(tools=[{"a": 1}, {"b": 2}]), "tools"),
    (_chat(tools=[{"a": "x" * 200}]), "tools"),
    (_chat(messages=[{"role": "user", "content": "x" * 1001}]), "messages"),
    (_chat(messages=[{"role": "user", "content": ""}] * 100), "messages"),
    (_chat(chat_template_kwargs={"chat_template": "x"}), "chat_template_kwargs"),
    (_chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (_chat(top_k=2**63), "top_k"),
    (_chat(temperature=float("nan")), "temperature"),
])
def test_parse_refuses_what_is_over_the_limits(body, param):
    r = parse("chat", body, LIMITS)
    assert isinstance(r, Rejected) and r.status == 400 and r.param == param, r


@pytest.mark.parametrize("body", [b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                                  b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
                                  b'{"messages": [{"role": "user", "content": "\xff"}]}'])
def test_parse_names_strings_that_are_not_unicode(body):
    r = parse("chat", body, LIMITS)
    assert isinstance(r, Rejected) and "Unicode" in r.message


def test_parse_gives_template_messages_as_plain_dicts():
    r = parse("chat", _chat(messages=[{"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]), LIMITS)
    assert isinstance(r, Parsed) and r.request.messages == []
    assert r.messages == [{"role": "system", "content": "ab"}]


def test_parse_pool_kills_a_worker_past_its_time_and_replaces_it():
    big = json.dumps({"messages": [{"role": "user", "content": "x"}] * 200_000}).encode()

    async def main():
        pool = ParsePool(1, LIMITS)
        await pool.start()
        try:
            with pytest.raises(PrepareTimeout):
                await pool.parse("chat", big, timeout=0.05)
            ok = json.dumps({"messages": [{"role": "user", "content": "y" * 900}]}).encode()
            r = await pool.parse("chat", ok + b" " * (INLINE_BODY_BYTES + 1), timeout=30)
            assert isinstance(r, Parsed) and len(r.messages[0]["content"]) == 900
        finally:
            await pool.close()

    asyncio.run(main())


def test_api_key_from_a_file_the_flag_or_the_environment(tmp_path, capsys):
    from skyline.cli import serve_api_key
    from skyline.config import ConfigError

    key = tmp_path / "key"
    key.write_text("s3cret\n")
    assert serve_api_key("flag", str(key), "env") == "s3cret"
    assert serve_api_key(None, None, "env") == "env"
    assert capsys.readouterr().err == ""
    assert serve_api_key("flag", None, "env") == "flag"
    assert "visible" in capsys.readouterr().err  # --api-key shows in ps: the CLI says so
    assert serve_api_key(None, None, None) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        serve_api_key(None, str(tmp_path / "empty"), None)
