"""POST /v1/completions: one or several prompts (text or token ids), n choices each."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from skyline.server.errors import APIError
from skyline.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    random_id,
)
from skyline.server.sampling import build_params, check_constraint
from skyline.server.serving import (
    SSE_DONE,
    Choice,
    ServerState,
    TextChunks,
    collect_whole,
    completion_logprobs,
    echo_logprobs,
    encode_text,
    log_finished,
    make_usage,
    merged,
    prompt_logprobs_body,
    sse,
    start_request,
    stream_error,
    stream_usage,
)
from skyline.types import RequestOutput, SamplingParams, TokenLogprobs

log = logging.getLogger("skyline.server")


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, a list of token ids, or a list of "
                            "either", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _encode_all(state: ServerState, prompts: list[str | list[int]]
                ) -> list[tuple[str | None, list[int]]]:
    """Each prompt's text (None for token ids) and token ids. Blocking: a preparation thread."""
    tok = state.llm.tokenizer
    out: list[tuple[str | None, list[int]]] = []
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer; send prompt token ids instead",
                               param="prompt")
            out.append((p, encode_text(tok, p)))
        else:
            out.append((None, p))
    return out


class _Batch:
    """The requests of one completion call, with their accumulated choices."""

    def __init__(self, state: ServerState, req: CompletionRequest, rid: str,
                 prompts: list[tuple[str | None, list[int]]], params: SamplingParams) -> None:
        self.state, self.req, self.rid = state, req, rid
        self.streams = []
        self.echo: list[str] = []
        self.prompt_ids = [ids for _, ids in prompts]
        # per prompt, once its first output brings them (SamplingParams.prompt_logprobs)
        self.prompt_lps: list[list[TokenLogprobs | None] | None] = [None] * len(prompts)
        try:
            for i, (text, ids) in enumerate(prompts):
                sub = rid if len(prompts) == 1 else f"{rid}-{i}"
                s = start_request(state, ids, params, sub, prompt_text=text)
                self.streams.append(s)
                self.echo.append(self._prompt_text(text, ids) if req.echo else "")
        except BaseException:
            for s in self.streams:
                s.close()
            raise
        self.num_prompt = sum(s.num_prompt_tokens for s in self.streams)
        self.trackers = [state.metrics.tracker(s.num_prompt_tokens) for s in self.streams]
        self.choices = [Choice() for _ in range(len(prompts) * req.n)]
        self.num_cached = [0] * len(prompts)

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        tok = self.state.llm.tokenizer  # ids passed check_prompt: at most a context's worth
        return tok.decode(ids, skip_special_tokens=False) if tok else ""

    def observe(self, i: int, out: RequestOutput) -> None:
        """An output of prompt `i`'s request (adding its choices is the caller's part)."""
        self.trackers[i].observe(out)
        self.num_cached[i] = out.num_cached_tokens
        self.prompt_lps[i] = self.prompt_lps[i] or out.prompt_logprobs

    def usage(self) -> Usage:
        return make_usage(self.num_prompt, self.choices, sum(self.num_cached))

    def finish(self) -> None:
        for i, t in enumerate(self.trackers):
            n = self.req.n
            t.finish([c.finish_reason for c in self.choices[i * n:(i + 1) * n]])

    def log_done(self) -> None:
        log_finished(self.rid, self.choices, self.trackers[0].arrival)

    def offset(self, index: int, choice: Choice) -> int:
        return len(self.echo[index // self.req.n]) + len(choice.text)

    def choice(self, j: int, c: Choice, text: str, lps: list[TokenLogprobs] | None,
               offset: int, first: bool) -> CompletionChoice:
        """Choice `j`'s body: `text` (its new text, or all of it) with the logprobs `lps` from
        text offset `offset`; its `first` body also carries the echoed prompt, its logprobs
        and vLLM's prompt_logprobs."""
        req, i = self.req, j // self.req.n
        logprobs = None
        if req.logprobs is not None:
            logprobs = (echo_logprobs(self.state, self.prompt_ids[i], self.prompt_lps[i],
                                      req.logprobs)
                        if first and req.echo and self.prompt_lps[i] else None)
            logprobs = completion_logprobs(self.state, lps or [], offset, logprobs)
        prompt_lps = None
        if first and req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_body(self.state, self.prompt_lps[i])
        return CompletionChoice(index=j, text=(self.echo[i] if first else "") + text,
                                logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, prompt_logprobs=prompt_lps)


async def create_completion(state: ServerState, raw: Request) -> Response:
    parsed, deadline = await state.parse("completion", raw)
    req: CompletionRequest = parsed.request
    state.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported by this server; use n", param="best_of")
    params, constrained_by = build_params(req, req.max_tokens, req.logprobs,
                                          state.llm.vocab_size)
    if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
        params.prompt_logprobs = req.logprobs  # the echoed prompt's logprobs
    prompts = _prompts(req.prompt)
    try:
        state.llm.check_fits(len(prompts) * req.n)
    except ValueError as e:
        raise APIError(400, str(e), param="n") from None

    def prepare() -> list[tuple[str | None, list[int]]]:
        check_constraint(params, constrained_by)
        return _encode_all(state, prompts)

    encoded = await state.in_thread(deadline, prepare)
    rid = random_id("cmpl")
    batch = _Batch(state, req, rid, encoded, params)
    log.info("%s: completion, %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s, stream=%s%s",
             rid, len(batch.streams), batch.num_prompt, req.n, req.max_tokens, req.stream,
             f", user={req.user}" if req.user else "")
    headers = {"X-Request-Id": rid}
    if req.stream:
        return StreamingResponse(_stream(batch), media_type="text/event-stream", headers=headers)

    async def collect() -> bool:
        async for i, out in merged(batch.streams):
            batch.observe(i, out)
            for c in out.outputs:
                batch.choices[i * req.n + c.index].add(c)
        return True

    def done() -> None:
        for s in batch.streams:
            s.close()
        batch.finish()

    if not await collect_whole(raw, rid, collect(), done):
        return Response(status_code=499)
    batch.log_done()
    choices = [batch.choice(j, c, c.text, c.logprobs, len(batch.echo[j // req.n]), True)
               for j, c in enumerate(batch.choices)]
    body = CompletionResponse(id=rid, model=state.model_name, choices=choices,
                              usage=batch.usage())
    return JSONResponse(body.model_dump(), headers=headers)


async def _stream(batch: _Batch) -> AsyncIterator[str]:
    req, state = batch.req, batch.state
    created = int(time.time())
    include_usage, continuous = stream_usage(req.stream_options)

    def chunk(items: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionResponse(id=batch.rid, created=created, model=state.model_name,
                                      choices=items, usage=usage))

    text_chunk = TextChunks(lambda j, text: CompletionResponse(
        id=batch.rid, created=created, model=state.model_name,
        choices=[CompletionChoice(index=j, text=text)]))
    # a choice's first chunk carries the echoed prompt and the prompt's logprobs, which come
    # with the prompt's first output
    sent = [False] * len(batch.choices)
    try:
        async for i, out in merged(batch.streams):
            batch.observe(i, out)
            items = []
            for c in out.outputs:
                j = i * req.n + c.index
                acc = batch.choices[j]
                if acc.finish_reason is not None:
                    continue
                offset = batch.offset(j, acc)
                acc.add(c)
                first = not sent[j] and (req.echo or req.prompt_logprobs is not None)
                if not (c.text or c.finish_reason or c.logprobs or first):
                    continue
                sent[j] = True
                if (not first and c.finish_reason is None and req.logprobs is None
                        and not continuous and len(out.outputs) == 1):
                    yield text_chunk(j, c.text)  # the common chunk: new text only
                    continue
                items.append(batch.choice(j, acc, c.text, c.logprobs, offset, first))
            if items:
                yield chunk(items, batch.usage() if continuous else None)
        if include_usage:
            yield chunk([], batch.usage())
        yield SSE_DONE
        batch.log_done()
    except Exception as e:
        yield stream_error(e)
        yield SSE_DONE
    finally:
        for s in batch.streams:
            s.close()
        batch.finish()
        if not all(c.finish_reason for c in batch.choices):
            log.info("%s: stream ended early (client gone or shutdown); aborted", batch.rid)
