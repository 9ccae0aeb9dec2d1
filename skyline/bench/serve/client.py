"""The load generator's client: one streamed request to an OpenAI-compatible endpoint (the
completions or the chat endpoint, a conversation's turns as one prompt or as messages), its
time to first token, inter-token gaps and usage filled into a RequestResult; the model id and
the token-id probe that makes prompts token-exact."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from skyline.bench.metrics import RequestResult
from skyline.bench.workloads import Conversation, Turn

if TYPE_CHECKING:
    from skyline.bench.serve.load import LoadSpec


class _Client:
    def __init__(self, load: LoadSpec, session: aiohttp.ClientSession) -> None:
        self.load, self.session = load, session
        self.url = load.base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if load.api_key:
            self.headers["Authorization"] = f"Bearer {load.api_key}"
        self.model = load.model or ""
        self.token_ids_ok = False

    async def resolve_model(self) -> None:
        if self.model:
            return
        async with self.session.get(f"{self.url}/models", headers=self.headers) as r:
            if r.status != 200:
                raise ConnectionError(f"GET {self.url}/models answered {r.status}; pass --model")
            self.model = (await r.json())["data"][0]["id"]

    async def tokenize(self, text: str) -> list[int] | None:
        """Token ids from the server's /tokenize (vLLM and skyline read `prompt`, llama.cpp's
        llama-server reads `content`), or None if it has none."""
        root = self.url[:-3] if self.url.endswith("/v1") else self.url
        body = {"model": self.model, "prompt": text, "content": text,
                "add_special_tokens": False}
        try:
            async with self.session.post(f"{root}/tokenize", json=body,
                                         headers=self.headers) as r:
                return (await r.json())["tokens"] if r.status == 200 else None
        except (aiohttp.ClientError, KeyError, ValueError):
            return None

    async def probe_token_ids(self, text: str) -> None:
        """Whether the completions endpoint takes token-id prompts (then prompts are exact)."""
        ids = await self.tokenize(text) if self.load.endpoint == "completions" else None
        if ids:
            res = await self.send(Conversation([Turn(ids[:8], 1, 8)]), 0, [], 0.0)
            self.token_ids_ok = res.success

    async def exact(self, turn: Turn) -> Turn:
        """The turn with a prompt of exactly input_len token ids, when the server allows."""
        if not self.token_ids_ok or isinstance(turn.prompt, list):
            return turn
        ids = await self.tokenize(turn.prompt)
        if not ids:
            return turn
        ids = (ids * (turn.input_len // len(ids) + 1))[: turn.input_len]
        return Turn(ids, turn.max_tokens, turn.input_len)

    def body(self, conv: Conversation, turn_idx: int, replies: list[str]) -> tuple[str, dict]:
        turn = conv.turns[turn_idx]
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": turn.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": self.load.temperature,
        }
        if self.load.top_p < 1.0:
            body["top_p"] = self.load.top_p
        if self.load.ignore_eos:
            body["ignore_eos"] = True  # vLLM/skyline extension: exact output lengths
            body["min_tokens"] = turn.max_tokens
        if self.load.endpoint == "chat":
            msgs = list(conv.messages or [])
            if not msgs:
                if conv.system:
                    msgs.append({"role": "system", "content": conv.system})
                for t, reply in zip(conv.turns[:turn_idx], replies, strict=True):
                    msgs += [{"role": "user", "content": _text(t.prompt)},
                             {"role": "assistant", "content": reply}]
                msgs.append({"role": "user", "content": _text(turn.prompt)})
            body["messages"] = msgs
            return f"{self.url}/chat/completions", body
        if isinstance(turn.prompt, list) and turn_idx == 0 and not conv.system:
            body["prompt"] = turn.prompt
        else:
            parts = [conv.system + "\n\n"] if conv.system else []
            for t, reply in zip(conv.turns[:turn_idx], replies, strict=True):
                parts.append(f"User: {_text(t.prompt)}\nAssistant: {reply}\n")
            parts.append(f"User: {_text(turn.prompt)}\nAssistant:" if len(conv.turns) > 1
                         else _text(turn.prompt))
            body["prompt"] = "".join(parts)
        return f"{self.url}/completions", body

    async def _post(self, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST, sent again once when a kept-alive connection proves closed before any answer
        (llama.cpp's llama-server closes it after each streamed response while advertising
        keep-alive; the request never reached the server)."""
        try:
            return await self.session.post(url, json=body, headers=self.headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            return await self.session.post(url, json=body, headers=self.headers)

    async def send(self, conv: Conversation, turn_idx: int, replies: list[str],
                   t_bench: float, res: RequestResult | None = None) -> RequestResult:
        """One streamed request, filled into `res` (a new result if None); the reply text is
        appended to `replies`."""
        url, body = self.body(conv, turn_idx, replies)
        if res is None:
            res = RequestResult(input_len=conv.turns[turn_idx].input_len)
        res.input_len = conv.turns[turn_idx].input_len
        chunks: list[str] = []
        usage: dict[str, Any] | None = None
        t0 = time.perf_counter()
        res.start = t0 - t_bench
        last = t0
        try:
            async with await self._post(url, body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                async for raw in r.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        raise RuntimeError(str(msg["error"])[:200])
                    usage = msg.get("usage") or usage
                    for c in msg.get("choices") or []:
                        text = c.get("text") if "text" in c else (c.get("delta") or {}).get(
                            "content")
                        if text:
                            now = time.perf_counter()
                            if not chunks:
                                res.ttft = now - t0
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks.append(text)
            res.e2e = time.perf_counter() - t0
            res.output_len = usage["completion_tokens"] if usage else len(chunks)
            if usage and usage.get("prompt_tokens"):
                res.input_len = usage["prompt_tokens"]
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
            res.success, res.error = False, f"{type(e).__name__}: {e}"[:300]
            res.e2e = time.perf_counter() - t0
        replies.append("".join(chunks))
        return res


def _text(prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))

