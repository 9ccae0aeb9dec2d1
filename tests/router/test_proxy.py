"""The router's HTTP behaviour over stub replicas: answers and errors pass through unchanged,
streams are relayed event by event, requests that did not start are retried elsewhere, a
replica that fails mid-stream ends the stream with an error event and [DONE], and the
router's own errors are OpenAI-shaped."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from tests.router.stub import Stub, router


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


async def events(url: str, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    """(arrival time, event) of each SSE event of a streamed request."""
    out = []
    async with aiohttp.ClientSession() as s, s.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                out.append((time.monotonic(), event))
    return out


def test_answers_and_errors_pass_through_unchanged():
    async def main() -> None:
        a = Stub("a")
        async with router([a]) as url:
            status, headers, body = await post(f"{url}/v1/completions", {"prompt": "err"})
            assert status == 400 and headers["x-request-id"] == "req-1"
            assert json.loads(body)["error"] == {"message": "bad", "type": "invalid_request_error",
                                                 "param": "prompt", "code": 400}
            assert headers["x-skyline-replica"] == f"127.0.0.1:{a.port}"
            status, _, body = await post(f"{url}/v1/completions", {"prompt": "hi"})
            assert status == 200 and json.loads(body)["choices"][0]["text"] == "a"
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/models") as r:
                    assert (await r.json())["data"][0]["id"] == "stub"
                async with s.get(f"{url}/nope") as r:
                    assert r.status == 404 and "no route /nope" in (await r.json())["error"][
                        "message"]
                async with s.get(f"{url}/metrics") as r:
                    text = await r.text()
            assert f'skyline_router:requests_total{{replica="127.0.0.1:{a.port}"}} 3.0' in text
            assert f'skyline_router:usage_cached_tokens_total{{replica="127.0.0.1:{a.port}"}} ' \
                   f'8.0' in text

    run(main())


def test_stream_is_relayed_event_by_event():
    async def main() -> None:
        a = Stub("a", events=4, gap=0.3)
        async with router([a]) as url:
            got = await events(f"{url}/v1/completions", {"prompt": "hi"})
            texts = [e for _, e in got]
            assert texts[-1] == b"data: [DONE]"
            assert [json.loads(e[5:])["choices"][0]["text"] for e in texts[:4]] == [
                "a0", "a1", "a2", "a3"]
            # not buffered: the events arrived as the stub wrote them, 0.3 s apart
            gaps = [t1 - t0 for (t0, _), (t1, _) in zip(got, got[1:4], strict=False)]
            assert min(gaps) > 0.15, gaps

    run(main())


def test_unstarted_requests_go_to_another_replica():
    async def main() -> None:
        a, b = Stub("a"), Stub("b")
        async with router([a, b], policy="round-robin", health_interval_s=30.0) as url:
            for mode in ("busy", "reset"):  # a answers 503 / drops the connection
                a.mode = mode
                for stream in (False, True):
                    status, h, body = await post(f"{url}/v1/completions",
                                                 {"prompt": "x", "stream": stream})
                    assert status == 200 and h["x-skyline-replica"] == f"127.0.0.1:{b.port}", (
                        mode, body)
            async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
                text = await r.text()
            retries = float(text.split(f'retries_total{{replica="127.0.0.1:{a.port}"}} ')[1]
                            .split()[0])
            assert retries >= 2  # at least once per mode; every request ended on b
            assert len(b.received) == 4

    run(main())


def test_a_refused_request_is_answered_with_the_replicas_error():
    async def main() -> None:
        a = Stub("a", mode="busy")
        async with router([a]) as url:
            status, _, body = await post(f"{url}/v1/completions", {"prompt": "x"})
            assert status == 503 and json.loads(body)["error"]["message"] == "down"

    run(main())


def test_replica_failure_mid_stream_ends_with_error_event():
    async def main() -> None:
        a = Stub("a", gap=0.05)
        async with router([a]) as url:
            got = [e for _, e in await events(f"{url}/v1/completions", {"prompt": "cut"})]
            assert [json.loads(e[5:])["choices"][0]["text"] for e in got[:2]] == ["a0", "a1"]
            err = json.loads(got[2][5:])["error"]
            assert err["code"] == 503 and err["type"] == "service_unavailable"
            assert got[3:] == [b"data: [DONE]"]

    run(main())


def test_router_errors_are_openai_shaped():
    async def main() -> None:
        a = Stub("a", healthy=False)
        async with router([a], api_key="k", max_body_bytes=1000) as url:
            status, h, body = await post(f"{url}/v1/completions", {"prompt": "x"})
            assert status == 401 and h["www-authenticate"] == "Bearer"
            auth = {"Authorization": "Bearer k"}
            status, _, body = await post(f"{url}/v1/completions", {
                "prompt": "x", "kv_transfer_params": {"transfer_id": "t", "peer": "tcp://h:1"}},
                auth)
            assert status == 400 and "set by the router" in json.loads(body)["error"]["message"]
            status, _, body = await post(f"{url}/v1/completions", {"prompt": "x" * 2000}, auth)
            assert status == 413 and "larger than 1000 bytes" in json.loads(body)["error"][
                "message"]
            status, h, body = await post(f"{url}/v1/completions", {"prompt": "x"}, auth)
            err = json.loads(body)["error"]
            assert status == 503 and err["type"] == "service_unavailable"
            assert "no replica can serve" in err["message"] and "/health answered 503" in err[
                "message"]
            async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
                assert r.status == 503
            a.healthy = True  # rejoins at the next health check
            await asyncio.sleep(0.5)
            status, _, _ = await post(f"{url}/v1/completions", {"prompt": "x"}, auth)
            assert status == 200

    run(main())


class WordHasher:
    """A prompt's 'blocks' are its words: prompts sharing leading words share hashes."""

    ready = True

    def load(self) -> None:
        pass

    def completion(self, body: dict[str, Any], block_size: int) -> tuple[int, list[bytes]]:
        words = str(body["prompt"]).split()
        return len(words), [" ".join(words[: i + 1]).encode() for i in range(len(words))]

    chat = completion


def test_cache_aware_keeps_a_prefix_on_one_replica():
    async def main() -> None:
        stubs = [Stub("a"), Stub("b")]
        async with router(stubs, hasher=WordHasher()) as url:
            where: dict[str, set[str]] = {}
            for i in range(12):
                group = f"group{i % 3}"
                _, h, _ = await post(f"{url}/v1/completions",
                                     {"prompt": f"{group} shared words then {i}"})
                where.setdefault(group, set()).add(h["x-skyline-replica"])
            assert all(len(v) == 1 for v in where.values()), where  # sticky
            assert len(set().union(*where.values())) == 2  # new prefixes spread out

    run(main())


def test_discovered_replicas_join_and_leave():
    async def main() -> None:
        a, b = Stub("a"), Stub("b")
        await a.start()
        await b.start()
        urls = [a.url]
        async with router([a, b], discover=lambda: list(urls)) as url:
            async with aiohttp.ClientSession() as s:
                async def replicas() -> set[str]:
                    async with s.get(f"{url}/metrics") as r:
                        text = await r.text()
                    return {line.split('"')[1] for line in text.splitlines()
                            if line.startswith("skyline_router:replica_healthy{")}

                await asyncio.sleep(0.5)
                assert await replicas() == {f"127.0.0.1:{a.port}"}  # b was not discovered
                urls[:] = [b.url]
                await asyncio.sleep(0.6)
                assert await replicas() == {f"127.0.0.1:{b.port}"}
                status, h, _ = await post(f"{url}/v1/completions", {"prompt": "x"})
                assert status == 200 and h["x-skyline-replica"] == f"127.0.0.1:{b.port}"

    run(main())
