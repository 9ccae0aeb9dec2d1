"""`skyline bench serve`: a streaming load generator for any OpenAI-compatible endpoint.

Load is fixed concurrency (N users, each sending its next request when the last one ends),
Poisson arrivals at a request rate, or both (arrivals capped at N in flight). A run ends after
`num_requests` requests or `duration` seconds, whichever comes first; requests in flight then
have `grace` seconds to finish. Nothing waits without bound on the server: the set-up requests
(model id, token-id probe, warm-up) have `setup_timeout` seconds, and at the hard deadline
(duration + grace) the requests still running are cut, recorded as failed, and the run reports
what it has. `heartbeat` prints a progress line every so many seconds (a stalled server shows).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from skyline.bench.metrics import RequestResult, format_table, summarize
from skyline.bench.server_stats import cache_delta, format_cache, scrape
from skyline.bench.workloads import Conversation, Turn, WorkloadSpec, iter_conversations

# Workloads whose prompts are made token-exact on the completions endpoint.
_EXACT = ("random", "long-context", "mixed")
CUT = "cut: still running at the hard deadline (duration + grace)"
MAX_WARMUP_WIDTH = 256  # warm-up requests sent at once, at most


@dataclass
class LoadSpec:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first id of /v1/models
    endpoint: str = "completions"  # completions | chat
    concurrency: int | None = None
    request_rate: float | None = None  # requests (conversations) per second, Poisson
    num_requests: int | None = 100
    duration: float | None = None  # seconds
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 6 * 3600.0
    warmup: int = 1  # rounds of warm-up requests, each as wide as `concurrency`
    seed: int = 0
    progress: bool = True
    grace: float = 60.0  # seconds requests in flight at the duration may take to finish
    setup_timeout: float = 600.0  # seconds for the model id, token-id probe and warm-up
    heartbeat: float = 0.0  # seconds between progress lines on stdout (0: none)


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


async def _setup(client: _Client, load: LoadSpec, workload: WorkloadSpec) -> None:
    """Model id, token-id probe and warm-up requests, before the clock starts."""
    await client.resolve_model()
    if workload.name in _EXACT:
        await client.probe_token_ids("The quick brown fox jumps over the lazy dog today.")
    # Each warm-up round sends as many requests at once as the run keeps in flight (prompts
    # the run never sends, 4 output tokens each), so the server meets the run's batch shapes
    # before the clock starts: a GPU server compiles a kernel variant the first time its
    # shape class appears, which would otherwise land in the first timed seconds.
    width = max(1, min(load.concurrency or 1, MAX_WARMUP_WIDTH))
    warm_convs = iter_conversations(dataclasses.replace(workload, seed=-1))
    for _ in range(load.warmup):
        sends = []
        for _ in range(width):
            warm = next(warm_convs)
            turn = Turn(warm.turns[0].prompt, min(4, warm.turns[0].max_tokens), 0)
            sends.append(client.send(dataclasses.replace(warm, turns=[turn]), 0, [], 0.0))
        for r in await asyncio.gather(*sends):
            if not r.success:
                raise ConnectionError(f"the warm-up request failed ({r.error})")


async def _run(load: LoadSpec, workload: WorkloadSpec) -> tuple[list[RequestResult], float,
                                                                 bool, str]:
    convs = iter_conversations(workload)
    timeout = aiohttp.ClientTimeout(total=load.timeout)
    session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
    try:
        client = _Client(load, session)
        try:
            async with asyncio.timeout(load.setup_timeout):
                await _setup(client, load, workload)
        except TimeoutError:
            raise ConnectionError(f"no answer to the set-up requests (model id, warm-up) within "
                                  f"{load.setup_timeout:g} s") from None
        results: list[RequestResult] = []
        bar = tqdm(total=load.num_requests, desc="requests", disable=not load.progress,
                   unit="req")
        sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
        rng = random.Random(load.seed)
        launched = 0
        t_bench = time.perf_counter()
        deadline = t_bench + load.duration if load.duration else float("inf")
        hard = deadline + load.grace  # requests still running then are cut

        def budget_left() -> bool:
            return ((load.num_requests is None or launched < load.num_requests)
                    and time.perf_counter() < deadline)

        async def converse(conv: Conversation) -> None:
            nonlocal launched
            replies: list[str] = []
            try:
                for i in range(len(conv.turns)):
                    if not budget_left():
                        return
                    launched += 1
                    res = RequestResult(conv.turns[i].input_len,
                                        start=time.perf_counter() - t_bench)
                    results.append(res)
                    try:
                        if workload.name in _EXACT:
                            conv.turns[i] = await client.exact(conv.turns[i])
                        await client.send(conv, i, replies, t_bench, res)
                    except asyncio.CancelledError:
                        res.success, res.error = False, CUT
                        res.e2e = time.perf_counter() - t_bench - res.start
                        raise
                    except Exception as e:  # an unexpected answer: recorded, the run goes on
                        res.success, res.error = False, f"{type(e).__name__}: {e}"[:300]
                        res.e2e = time.perf_counter() - t_bench - res.start
                    bar.update(1)
            finally:
                if sem is not None:
                    sem.release()

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(load.heartbeat)
                now = time.perf_counter()
                done = sum(r.e2e > 0 for r in results)
                late = " (past the duration)" if now > deadline else ""
                print(f"    {now - t_bench:.0f} s: {done} requests done, "
                      f"{len(results) - done} in flight{late}", flush=True)

        async def issue() -> None:
            while budget_left():
                if load.request_rate:
                    await asyncio.sleep(rng.expovariate(load.request_rate))
                if sem is not None:
                    await sem.acquire()
                if not budget_left():
                    if sem is not None:
                        sem.release()
                    break
                task = asyncio.create_task(converse(next(convs)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if sem is None and not load.request_rate:
                    await asyncio.sleep(0)  # unbounded burst: everything at once
            while tasks:
                await asyncio.wait(list(tasks))

        tasks: set[asyncio.Task] = set()
        beat = asyncio.create_task(heartbeat()) if load.heartbeat > 0 else None
        try:
            async with asyncio.timeout(hard - time.perf_counter() if load.duration else None):
                await issue()
        except TimeoutError:
            pass  # the hard deadline: cut what still runs, below
        finally:
            left = [t for t in list(tasks) if not t.done()]
            for t in left + ([beat] if beat else []):
                t.cancel()
            await asyncio.gather(*left, *([beat] if beat else []), return_exceptions=True)
        duration = time.perf_counter() - t_bench
        bar.close()
        return results, duration, client.token_ids_ok, client.model
    finally:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):  # never wait on the server to close connections
                await session.close()


def _run_loop(coro: Any) -> Any:
    """`asyncio.run` without its unbounded waits at exit: tasks left over are cancelled and get
    5 s, and the default executor is not joined."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=5))
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 5))
        except (TimeoutError, RuntimeError):
            pass
        finally:
            loop.close()


def run_load(load: LoadSpec, workload: WorkloadSpec) -> tuple[list[RequestResult], float, bool,
                                                              str]:
    """Run the load once: per-request results, the run's duration in seconds, whether prompts
    were token-exact, and the served model id."""
    if load.endpoint not in ("completions", "chat"):
        raise ValueError("--endpoint must be completions or chat")
    if load.num_requests is None and load.duration is None:
        raise ValueError("give --num-requests or --duration to bound the run")
    if load.concurrency is not None and load.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if load.grace < 0 or load.setup_timeout <= 0:
        raise ValueError("grace must be >= 0 and setup_timeout > 0 seconds")
    next(iter_conversations(workload))  # argument errors before any network traffic
    try:
        return _run_loop(_run(load, workload))
    except (aiohttp.ClientError, OSError) as e:
        raise ValueError(f"cannot reach {load.base_url} ({e}); is the server running?") from None


def run_serve_bench(load: LoadSpec, workload: WorkloadSpec, slos: dict[str, float] | None = None,
                    output: str | None = None, print_table: bool = True) -> dict[str, Any]:
    """Run the load, print a table, optionally write JSON; returns the result dict."""
    before = scrape(load.base_url, load.api_key)
    results, duration, exact, model = run_load(load, workload)
    summary = summarize(results, duration, slos)
    cache = cache_delta(before, scrape(load.base_url, load.api_key))
    if cache is not None:
        summary["server_cache"] = cache
    out = {
        "benchmark": "serve",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": load.base_url, "model": model, "endpoint": load.endpoint,
        "load": {k: v for k, v in dataclasses.asdict(load).items() if k != "api_key"},
        "workload": dataclasses.asdict(workload),
        "token_exact_prompts": exact,
        "cut_requests": sum(r.error == CUT for r in results),
        "summary": summary,
        "requests": [{"start": r.start, "input_len": r.input_len, "output_len": r.output_len,
                      "cached_tokens": r.cached_tokens, "ttft": r.ttft, "e2e": r.e2e,
                      "success": r.success, "error": r.error}
                     for r in results],
    }
    if print_table:
        print(format_table(summary))
        if cache is not None:
            print(format_cache(cache))
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(out, f, indent=1)
        if print_table:
            print(f"wrote {output}")
    return out


def _load_process(job: tuple[LoadSpec, WorkloadSpec]) -> tuple[list[RequestResult], float]:
    results, seconds, _, _ = run_load(*job)
    return results, seconds


class LoadProcesses:
    """The load split over several client processes, started at once: one Python client
    saturates near 9k streamed tokens/s, below what one GPU serves. Each process keeps its
    share of the concurrency and of the requests, with its own seed; `wait` returns every
    request's result and the longest run's seconds."""

    def __init__(self, load: LoadSpec, workload: WorkloadSpec, processes: int) -> None:
        import multiprocessing

        conc = load.concurrency or 1
        processes = max(1, min(processes, conc))
        jobs = []
        for i in range(processes):
            share = conc // processes + (i < conc % processes)
            num = None if load.num_requests is None else (
                load.num_requests // processes + (i < load.num_requests % processes))
            jobs.append((dataclasses.replace(load, concurrency=share, num_requests=num,
                                             seed=load.seed + i, progress=False),
                         dataclasses.replace(workload, seed=workload.seed + i)))
        self._pool = multiprocessing.get_context("spawn").Pool(len(jobs))
        self._pending = self._pool.map_async(_load_process, jobs)

    def wait(self) -> tuple[list[RequestResult], float]:
        try:
            outs = self._pending.get()
        finally:
            self._pool.close()
            self._pool.join()
        return [r for rs, _ in outs for r in rs], max(s for _, s in outs)


def http_stack() -> str:
    """What uvicorn serves with here: its C event loop and HTTP parser when installed."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"{loop} + {'httptools' if importlib.util.find_spec('httptools') else 'h11'}"
