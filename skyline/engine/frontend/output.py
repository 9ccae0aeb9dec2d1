"""Turns engine-core step outputs into user-facing RequestOutputs: detokenization, stop strings,
n > 1 fan-out and merge, latency bookkeeping. Shared by the offline LLM and the server."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from skyline.engine.frontend.detokenizer import IncrementalDetokenizer
from skyline.engine.frontend.tokenizer import Tokenizer
from skyline.types import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    # Children of an n > 1 request are independent draws; with a seed, seed + index each,
    # modulo 2**64: the sampler mixes seeds modulo 2**64, so the wrap changes no draw, and
    # every child seed stays a 64-bit value the engine can carry.
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return dataclasses.replace(params, n=1, seed=seed)


def child_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)
    ends_on_token: bool = True  # the token that stops it is left out of its text

    @property
    def text(self) -> str:
        return self.detok.text if self.detok else ""


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: from the first child that reports them; `prompt_sent`:
    # whether a delta output carried them already
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, id_prefix: str = "") -> None:
        """`id_prefix`: before each engine-core request id (see AsyncLLM)."""
        self.tokenizer = tokenizer
        self.id_prefix = id_prefix
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[str]:
        """Register a request; returns the engine-core request ids of its children."""
        ids = [self.id_prefix + cid for cid in child_ids(request_id, params.n)]
        children = {}
        for i, cid in enumerate(ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens, params.stop,
                    params.include_stop_str_in_output,
                )
            children[cid] = _Child(i, detok, logprobs=[] if params.logprobs is not None else None,
                                   ends_on_token=not params.include_stop_str_in_output)
            self.child_to_parent[cid] = request_id
        self.parents[request_id] = _Parent(request_id, prompt, list(prompt_token_ids), params,
                                           children)
        return ids

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished children's ids for the engine to abort."""
        p = self.parents.pop(request_id, None)
        if p is None:
            return []
        for cid in p.children:
            self.child_to_parent.pop(cid, None)
        return [cid for cid, c in p.children.items() if c.finish_reason is None]

    def process(self, outputs: list[StepOutput], delta: bool = False, final_only: bool = False
                ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests (`final_only`: the finished ones, which saves building an
        output per request per step) and the engine ids to abort (stop strings matched)."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        done: dict[str, _Parent] = {}  # parents whose last running child finished now
        for o in outputs:
            pid = self.child_to_parent.get(o.request_id)
            if pid is None:
                continue
            p = self.parents[pid]
            c = p.children[o.request_id]
            p.num_cached_tokens = max(p.num_cached_tokens, o.num_cached_tokens)
            if o.prompt_logprobs is not None and p.prompt_logprobs is None:
                p.prompt_logprobs = [None, *o.prompt_logprobs]
            if o.new_token_ids:
                if p.first_token is None:
                    p.first_token = now
                elif p.last_token is not None:
                    p.itl.append(now - p.last_token)
                p.last_token = now
            was_running = c.finish_reason is None
            self._apply(c, o)
            if was_running and c.finish_reason is not None:
                if o.finish_reason is None:
                    to_abort.append(o.request_id)  # a stop string ended it before the engine
                if p.finished:
                    done[pid] = p
            touched[pid] = p
        finished = list(done.values())
        results = [self._output(p, delta) for p in (finished if final_only else touched.values())]
        for p in finished:
            self.abort(p.request_id)
        return results, to_abort

    def _apply(self, c: _Child, o: StepOutput) -> None:
        if c.finish_reason is not None:  # already stopped by a stop string
            return
        c.token_ids.extend(o.new_token_ids)
        c.delta_ids.extend(o.new_token_ids)
        if o.new_logprobs and c.logprobs is not None:
            c.logprobs.extend(o.new_logprobs)
            c.delta_logprobs.extend(o.new_logprobs)
        if c.detok is not None:
            ids = o.new_token_ids
            if c.ends_on_token and o.finish_reason == "stop" and not isinstance(
                    o.stop_reason, str):
                ids = ids[:-1]  # the end-of-sequence or stop token is not text (as vLLM)
            c.delta_text += c.detok.step(ids)
            if c.detok.stop_matched is not None:
                c.finish_reason, c.stop_reason = "stop", c.detok.stop_matched
                return
            if o.finish_reason is not None:
                c.delta_text += c.detok.flush()
        if o.finish_reason is not None:
            c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason

    def _output(self, p: _Parent, delta: bool) -> RequestOutput:
        outs = []
        for c in p.children.values():
            if delta:
                outs.append(CompletionOutput(c.index, c.delta_text, c.delta_ids, c.finish_reason,
                                             c.stop_reason,
                                             c.delta_logprobs if c.logprobs is not None else None))
                c.delta_text, c.delta_ids, c.delta_logprobs = "", [], []
            else:
                outs.append(CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason,
                                             c.stop_reason, c.logprobs))
        metrics: dict[str, float] = {}
        if p.first_token is not None:
            metrics["ttft"] = p.first_token - p.arrival
        if p.finished and p.last_token is not None:
            metrics["e2e"] = p.last_token - p.arrival
            metrics["mean_itl"] = sum(p.itl) / len(p.itl) if p.itl else 0.0
        prompt_lps = p.prompt_logprobs
        if delta:  # carried once
            prompt_lps = None if p.prompt_sent else prompt_lps
            p.prompt_sent = p.prompt_sent or prompt_lps is not None
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outs, p.finished,
                             p.num_cached_tokens, metrics, prompt_lps)


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two successive delta outputs of one request as one (`b` came later): what a reader
    that fell behind gets, so that it writes one chunk for several steps, not one each."""
    outs = []
    for x, y in zip(a.outputs, b.outputs, strict=True):
        lps = x.logprobs if y.logprobs is None else (x.logprobs or []) + y.logprobs
        done = y.finish_reason is not None
        outs.append(CompletionOutput(
            x.index, x.text + y.text, x.token_ids + y.token_ids,
            y.finish_reason if done else x.finish_reason,
            y.stop_reason if done else x.stop_reason, lps))
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, outs, b.finished,
                         b.num_cached_tokens, {**a.metrics, **b.metrics},
                         a.prompt_logprobs if a.prompt_logprobs is not None
                         else b.prompt_logprobs)
