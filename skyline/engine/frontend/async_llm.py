"""AsyncLLM: the asyncio front end of an engine core running in its own process.

It owns the tokenizer and the OutputProcessor (detokenization, stop strings, n > 1) in the API
process. One asyncio task reads the core's outputs and feeds per-request queues;
`generate` yields RequestOutput deltas and aborts the request in the core (freeing its KV
blocks) as soon as the caller stops listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from skyline.engine.codec import request_to_dict, step_output_from_list
from skyline.engine.frontend.early_tokenizer import EarlyTokenizer
from skyline.engine.frontend.output import OutputProcessor, child_params, merge_deltas
from skyline.engine.frontend.structured import check_structured, constrained
from skyline.engine.supervisor import EngineDeadError, EngineSupervisor, RestartPolicy
from skyline.types import Request, RequestOutput, SamplingParams, is_valid_unicode
from skyline.types.startup import StartupPhases, expand

log = logging.getLogger(__name__)


WAITING_PER_SEQ = 4  # default waiting-queue bound, per place in the running batch


class EngineOverloadedError(Exception):
    """The waiting queue is full: the caller should retry later."""


class RequestStream:
    """One request's output deltas, as an async iterator."""

    def __init__(self, llm: AsyncLLM, request_id: str,
                 queue: asyncio.Queue[RequestOutput | Exception], num_prompt_tokens: int) -> None:
        self.llm = llm
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue = queue
        self.finished = False
        self._closed = False
        self._error: Exception | None = None  # met while merging deltas: raised next

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        queue = self._queue
        item = self._error if self._error is not None else await queue.get()
        # A reader that fell behind takes every delta waiting as one: one chunk to encode and
        # one socket write for several steps, so the API process catches up instead of
        # falling further behind at high concurrency. An error behind them comes next call.
        while not isinstance(item, Exception) and not item.finished and not queue.empty():
            nxt = queue.get_nowait()
            if isinstance(nxt, Exception):
                self._error = nxt
                break
            item = merge_deltas(item, nxt)
        if isinstance(item, Exception):
            self.close()
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Release the request; abort it in the engine if it has not finished."""
        if not self._closed:
            self._closed = True
            self.llm._release(self.request_id, self.finished)


class AsyncLLM:
    """Serve one model from an engine-core process. Construct outside or inside an event loop;
    use from one event loop."""

    def __init__(self, args: Any, startup_timeout: float | None = None,
                 restart: RestartPolicy | None = None,
                 on_fatal: Callable[[str], None] = lambda reason: None,
                 max_waiting: int | None = None, chat_template: str | None = None,
                 link: Callable[..., Any] | None = None, id_prefix: str = "") -> None:
        """`max_waiting`: requests that may wait for a place in the running batch before new
        ones get EngineOverloadedError (None or negative: the engine args' value if positive,
        else WAITING_PER_SEQ x max_num_seqs; 0: no limit). `chat_template`: the operator's
        template, instead of the model's. `link`: instead of starting an engine core from
        `args`, connect to a shared one: called with the callbacks, it returns an object with
        EngineSupervisor's interface (engine/clients.py's EngineClient). `id_prefix`: put before
        every id this process sends the core (API processes sharing a core must not collide)."""
        callbacks = {"on_message": self._handle, "on_death": self._on_death,
                     "on_restart": self._on_restart, "on_fatal": on_fatal}
        # Seconds of this start by phase: the engine process's (as it recorded them), then
        # what this process waited for after it.
        self.startup = StartupPhases()
        early = EarlyTokenizer(args, chat_template)
        try:
            with self.startup.phase("engine_process"):
                self.engine: Any = (
                    EngineSupervisor(args, startup_timeout, restart or RestartPolicy(),
                                     **callbacks)
                    if link is None else link(**callbacks))
        except BaseException:
            early.drop()
            raise
        self.id_prefix = id_prefix
        info = self.engine.info
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        if max_waiting is None or max_waiting < 0:
            configured = info.get("max_waiting") or 0
            max_waiting = configured if configured > 0 else WAITING_PER_SEQ * info["max_num_seqs"]
        self.max_waiting: int = max_waiting
        try:
            with self.startup.phase("tokenizer"):
                self.tokenizer = early.result(info["model_path"], info["load_format"])
        except BaseException:
            self.engine.shutdown(0)
            raise
        self.startup.seconds = expand(self.startup.seconds, "engine_process",
                                      info.get("startup", {}))
        eos = info["eos_token_ids"]
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            eos = self.tokenizer.eos_token_ids
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.outputs = OutputProcessor(self.tokenizer, id_prefix)
        self.stats: dict[str, Any] = {}  # the core's latest counters (pushed every step)
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._queue_times: dict[str, float] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        # From a random start: the core queues what it sends a killed API process and hands
        # it to the one started at its index, whose own calls must not take those answers
        self._call_ids = itertools.count(secrets.randbits(48))
        self._num_adds = 0

    @property
    def info(self) -> dict[str, Any]:
        """What the engine serves (model, device, KV cache, the engine core's pid)."""
        return self.engine.info

    @property
    def dead(self) -> str | None:
        """Why no request can be served now (the engine is restarting, gone or shutting down);
        None while it serves."""
        return self.engine.dead

    @property
    def num_restarts(self) -> int:
        return self.engine.num_restarts

    # ------------------------------------------------------------------ public API

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; send prompt token ids instead")
            if not is_valid_unicode(prompt):
                raise ValueError("the prompt is not valid Unicode (it holds a lone surrogate "
                                 "such as \\ud800); send UTF-8 text")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with one sentence if the request can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but this model's context length is "
                f"{self.max_model_len}; shorten the prompt"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's context length is {self.max_model_len} tokens, but "
                f"{n + params.max_tokens} were requested ({n} in the prompt and "
                f"{params.max_tokens} for the output); lower max_tokens or shorten the prompt"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in 0..{self.vocab_size - 1}")

    def check_fits(self, num_seqs: int) -> None:
        """Raise ValueError if `num_seqs` sequences asked at once could never be queued (an
        overloaded server would make the caller retry in vain)."""
        if self.max_waiting and num_seqs > self.max_waiting:
            raise ValueError(f"the request asks for {num_seqs} sequences at once, but this "
                             f"server queues at most {self.max_waiting}; lower n (or send "
                             "fewer prompts per request)")

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None,
                    structured_checked: bool = False) -> RequestStream:
        """Validate and queue a request; iterate the stream for its output deltas, and `close`
        it when done (closing an unfinished stream aborts the request). `structured_checked`:
        the caller ran `check_structured` on `params` (off the event loop: a large schema
        takes milliseconds to compile).

        Raises ValueError for a request that can never run, EngineOverloadedError when the
        waiting queue is full and EngineDeadError when the engine is gone."""
        self.engine.start()
        if self.dead:
            raise EngineDeadError(self.dead)
        text, ids = self.encode(prompt)
        text = text if text is not None else prompt_text
        params.validate(self.vocab_size)
        if not structured_checked:
            check_structured(params)
        if self.tokenizer is None and constrained(params):
            raise ValueError("structured output needs the model's tokenizer, and this model has "
                             "none")
        self.check_prompt(ids, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_fits(params.n)
        if self.max_waiting and self.num_waiting + params.n > self.max_waiting:
            raise EngineOverloadedError(
                f"the server has {self.num_waiting} requests waiting (limit {self.max_waiting}); "
                "retry later"
            )
        # Everything above only checks: nothing is registered until here, and whatever fails
        # below (a dead engine, a value msgpack cannot carry) unregisters what was, so a
        # refused request leaves nothing behind in this process or in the engine.
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        children = self.outputs.add_request(request_id, text, ids, params)
        try:
            for i, cid in enumerate(children):
                req = Request(cid, ids, child_params(params, i), eos_token_ids=self.eos_token_ids)
                self.engine.send(("add", request_to_dict(req)))
                self._num_adds += 1
        except BaseException:
            self.abort(request_id)
            raise
        self._queues[request_id] = queue
        return RequestStream(self, request_id, queue, len(ids))

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output deltas (text and tokens since the last one); stopping
        the iteration early (or cancelling the task) aborts the request."""
        stream = self.add_request(prompt, params, request_id, prompt_text)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _release(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        self._queue_times.pop(request_id, None)
        if not finished:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now; the core frees its KV blocks before its next step."""
        ids = self.outputs.abort(request_id)
        if ids and not self.dead:
            with contextlib.suppress(EngineDeadError):
                self.engine.send(("abort", ids))

    @property
    def num_waiting(self) -> int:
        """The core's waiting queue, counting requests sent but not yet seen by the core."""
        in_flight = self._num_adds - int(self.stats.get("num_adds", 0))
        return int(self.stats.get("num_waiting", 0)) + max(in_flight, 0)

    async def call(self, method: str, *args: Any, timeout: float = 5.0) -> Any:
        """Run a utility method in the core between steps ("stats", "reset_prefix_cache")."""
        self.engine.start()
        if self.dead:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self.engine.send(("call", call_id, method, list(args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def refresh_stats(self) -> dict[str, Any]:
        """Ask the core for its counters now (between two steps); on timeout keep the last."""
        try:
            self.stats = await self.call("stats", timeout=2.0)
        except (TimeoutError, EngineDeadError):
            pass
        return self.stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (in-flight requests end with EngineDeadError). Idempotent."""
        self.engine.shutdown(timeout)
        self._fail_all(EngineDeadError(self.dead or "the server is shutting down"))

    def cut_all(self, reason: str) -> None:
        """End every request in flight now with EngineDeadError(reason) (their streams say
        so), and abort them in the engine."""
        self._fail_all(EngineDeadError(reason))
        for rid in list(self.outputs.parents):
            self.abort(rid)

    # ------------------------------------------------------------------ internals

    def _fail_all(self, err: Exception) -> None:
        for q in self._queues.values():
            q.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)

    def _on_death(self, reason: str) -> None:
        """The engine died: every request in flight fails now (their streams report it), and
        nothing of them is kept for the engine that replaces it."""
        self._fail_all(EngineDeadError(reason))
        self.outputs = OutputProcessor(self.tokenizer, self.id_prefix)
        self._queue_times.clear()
        self.stats = {}
        self._num_adds = 0

    def _on_restart(self) -> None:
        self.stats = {}
        self._num_adds = 0

    def _handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "out":
            _, raw, stats, queue_times = msg
            self.stats = stats
            for cid, seconds in queue_times.items():
                pid = self.outputs.child_to_parent.get(cid)
                if pid is not None:
                    self._queue_times.setdefault(pid, seconds)
            if raw:
                self._dispatch([step_output_from_list(v) for v in raw])
        elif kind == "add_error":
            pid = self.outputs.child_to_parent.get(msg[1])
            if pid is not None:
                q = self._queues.get(pid)
                self.abort(pid)
                if q is not None:
                    q.put_nowait(ValueError(msg[2]))
        elif kind == "result":
            fut = self._calls.get(msg[1])
            if fut is not None and not fut.done():
                fut.set_result(msg[2])

    def _dispatch(self, outputs: list[Any]) -> None:
        results, to_abort = self.outputs.process(outputs, delta=True)
        if to_abort:
            with contextlib.suppress(EngineDeadError):
                self.engine.send(("abort", to_abort))
        for r in results:
            q = self._queues.get(r.request_id)
            if q is None:
                continue
            qt = self._queue_times.get(r.request_id)
            if qt is not None:
                r.metrics["queue_time"] = qt
            q.put_nowait(r)
