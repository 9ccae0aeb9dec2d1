"""The server's defences without a model: the guard middleware (500s that keep the connection),
request limits, the chat-template sandbox and log escaping."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.testclient import TestClient

from skyline.server.guard import Guard


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
