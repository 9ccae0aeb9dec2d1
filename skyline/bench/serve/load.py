"""The load of `skyline bench serve`: fixed concurrency, Poisson arrivals or both, bounded by a
request count or a duration with a grace and a hard deadline (the package's docstring); the
set-up before the clock starts; the load split over client processes (`LoadProcesses`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from skyline.bench.metrics import RequestResult
from skyline.bench.serve.client import _Client
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
    top_p: float = 1.0  # sent when below 1
    api_key: str | None = None
    timeout: float = 6 * 3600.0
    warmup: int = 1  # rounds of warm-up requests, each as wide as `concurrency`
    seed: int = 0
    progress: bool = True
    grace: float = 60.0  # seconds requests in flight at the duration may take to finish
    setup_timeout: float = 600.0  # seconds for the model id, token-id probe and warm-up
    heartbeat: float = 0.0  # seconds between progress lines on stdout (0: none)


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


def _load_process(job: tuple[LoadSpec, WorkloadSpec]) -> tuple[list[RequestResult], float]:
    results, seconds, _, _ = run_load(*job)
    return results, seconds


def split_load(load: LoadSpec, workload: WorkloadSpec, processes: int
               ) -> list[tuple[LoadSpec, WorkloadSpec]]:
    """The load of each of `processes` client processes (at most one a user): its share of
    the concurrency, of the requests and of the request rate, with its own seed."""
    conc = load.concurrency or 1
    processes = max(1, min(processes, conc))
    jobs = []
    for i in range(processes):
        share = conc // processes + (i < conc % processes)
        num = None if load.num_requests is None else (
            load.num_requests // processes + (i < load.num_requests % processes))
        rate = load.request_rate and load.request_rate * share / conc
        jobs.append((dataclasses.replace(load, concurrency=share, num_requests=num,
                                         request_rate=rate, seed=load.seed + i, progress=False),
                     dataclasses.replace(workload, seed=workload.seed + i)))
    return jobs


class LoadProcesses:
    """The load split over several client processes, started at once (`split_load`): one
    Python client saturates near 9k streamed tokens/s, below what one GPU serves; `wait`
    returns every request's result and the longest run's seconds."""

    def __init__(self, load: LoadSpec, workload: WorkloadSpec, processes: int) -> None:
        import multiprocessing

        jobs = split_load(load, workload, processes)
        self._pool = multiprocessing.get_context("spawn").Pool(len(jobs))
        self._pending = self._pool.map_async(_load_process, jobs)

    def wait(self) -> tuple[list[RequestResult], float]:
        try:
            outs = self._pending.get()
        finally:
            self._pool.close()
            self._pool.join()
        return [r for rs, _ in outs for r in rs], max(s for _, s in outs)

