"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

Each step `schedule` spends a token budget: first on running requests in admission order (a
decode costs one token, an unfinished prefill its next chunk), then on waiting requests, first
come first served. A request is only "computed" up to `num_computed_tokens`, advanced at schedule
time; `update` appends the sampled tokens and decides who finished.

Speculative decoding: a decoding request with drafts from the runner is scheduled 1 + k tokens
(k from `sched/spec`, within the budget, the context and max_tokens) and its blocks cover them.
`update` appends the accepted drafts and the target's token, checking stops token by token, and
rolls `num_computed_tokens` back by the rejected drafts; blocks holding only rejected slots are
freed at once and the runner told to drop them (`CachedRequestData.num_freed_blocks`).
Whether the next step speculates is decided once, by `can_overlap` or `schedule`, by the
policy's measured gate, fed each step's wall time through `record_step`.

Invariants between calls:
- `running` is in admission order; every running request holds blocks for its computed tokens.
- waiting (and preempted) requests hold no blocks and have `num_computed_tokens == 0`;
  requests waiting for KV from a connector (sched/kv_loads.py) hold the blocks being filled.
- `_finished_ids` holds every id the runner must forget before the next step.

Call order: `schedule`, run the step, `update`, and `add_request` / `abort_requests` only between
an `update` and the next `schedule` (the engine loop does).

Async scheduling (engine/core.py): step n+1 may be scheduled before step n's `update`, so that
the host prepares n+1 while the device runs n. A request that samples in a step holds an output
placeholder until its token arrives (`Request.num_output_placeholders`); a decode is scheduled
past it, the runner feeding the token to the next step on the device. Stops are seen one step
late: a request that finished in step n was also scheduled in n+1, and that step's token is
dropped. A block freed in `update(n)` may still be written by step n+1, which was queued on the
device before any step that can reuse it, so device order keeps it safe. Speculative decoding
and constrained decoding need each step's tokens before the next is scheduled: `can_overlap`
says when the engine must update first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from skyline.cache.connector import KVConnectorScheduler
from skyline.cache.kv_manager import KVCacheManager
from skyline.config import CacheConfig, SchedulerConfig, SpecConfig
from skyline.sched.kv_loads import KVLoads
from skyline.sched.spec import SpecPolicy
from skyline.sched.stop import (
    append_until_stop,
    receive_prompt_logprobs,
    scores_prompt,
    step_output,
)
from skyline.types import (
    CachedRequestData,
    NewRequestData,
    Request,
    RequestStatus,
    RunnerOutput,
    SchedulerOutput,
    StepOutput,
    TokenLogprobs,
)


class Scheduler:
    """Decides, every step, which requests run and how many tokens each."""

    def __init__(
        self,
        sched_cfg: SchedulerConfig,
        cache_cfg: CacheConfig,
        num_blocks: int,
        spec_cfg: SpecConfig | None = None,
        structured: Any = None,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.cfg = sched_cfg
        self.block_size = cache_cfg.block_size
        # The engine sizes the cache so that one request of max_model_len always fits: without it
        # a lone request could never make progress.
        assert num_blocks * cache_cfg.block_size >= sched_cfg.max_model_len, (
            f"{num_blocks} blocks of {cache_cfg.block_size} tokens cannot hold one request of "
            f"max_model_len={sched_cfg.max_model_len}"
        )
        self.kv_manager = KVCacheManager(
            num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching, connector,
            record_events=cache_cfg.kv_events,
        )
        self.kv_loads = KVLoads(connector, self.kv_manager)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # Optional structured-output hooks (engine/frontend/structured.py): before_step(out)
        # fills out.token_masks, after_step(out, res) advances the matchers.
        self.structured = structured
        # Speculative decoding: the runner's latest drafts per running request, and tail blocks
        # freed since the request last ran (the runner drops them when it next runs).
        self.spec = SpecPolicy(spec_cfg) if spec_cfg is not None and spec_cfg.enabled else None
        self._drafts: dict[str, list[int]] = {}
        self._num_freed_blocks: dict[str, int] = {}
        self._constrained: set[str] = set()  # requests with structured-output constraints
        # The next step's (within the static bound, speculates), decided once (_speculates_next)
        self._next: tuple[bool, bool] | None = None

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises ValueError if it can never run (the frontend validates
        first; this is the last line of defence)."""
        if req.request_id in self.requests or self.kv_loads.holds(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        max_len = self.max_len(req)
        if not 0 < req.num_tokens < max_len:
            raise ValueError(
                f"request {req.request_id!r} has {req.num_tokens} prompt tokens; it needs between "
                f"1 and {max_len - 1} to leave room for output within max_model_len={max_len}"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        p = req.sampling_params
        if p.json_schema or p.regex or p.grammar:
            self._constrained.add(req.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Drop requests and free their blocks now. Unknown or finished ids are ignored.
        Aborted requests produce no StepOutput: whoever aborted them already knows."""
        aborted = set()
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.kv_loads.release(req)
            self._forget_spec(rid)
            req.status = RequestStatus.FINISHED_ABORTED
            aborted.add(rid)
            self._finished_ids.add(rid)
        if aborted:
            self.running = [r for r in self.running if r.request_id not in aborted]
            self.waiting = deque(r for r in self.waiting if r.request_id not in aborted)

    def has_unfinished(self) -> bool:
        """Requests to run, or KV transfers to see end."""
        return bool(self.requests) or self.kv_loads.busy

    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the previous step's `update`: not
        when it speculates (drafts come from the previous step's tokens) nor while a
        constrained request exists (its token mask needs the previous token)."""
        return not self._constrained and not self._speculates_next()

    def _speculates_next(self) -> bool:
        """The gate's decision for the next step, made once and kept until `schedule`."""
        if self.spec is None:
            return False
        if self._next is None:
            n = self._num_pending_tokens()
            self._next = self.spec.enabled(n), self.spec.speculates(n, len(self.running))
        return self._next[1]

    def record_step(self, sched_out: SchedulerOutput, num_tokens: int, seconds: float) -> None:
        """The engine's timing of a step that was updated (`SpecPolicy.record_step`)."""
        if self.spec is not None:
            self.spec.record_step(sched_out, num_tokens, seconds)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def max_len(self, req: Request) -> int:
        """The request's cap on prompt + output tokens."""
        return min(self.cfg.max_model_len, req.max_model_len or self.cfg.max_model_len)

    def stats(self) -> dict[str, float]:
        spec = self.spec.stats() if self.spec is not None else {}
        return spec | self.kv_loads.stats() | {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_usage": self.kv_manager.usage,
            "prefix_cache_hit_tokens": self.kv_manager.prefix_hits,
            "prefix_cache_query_tokens": self.kv_manager.prefix_queries,
            "prefix_cache_hit_rate": self.kv_manager.hit_rate,
            "num_preemptions": self.num_preemptions,
        }

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache() + self.kv_loads.reset()

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts; allocate their blocks.

        The runner must drop `finished_request_ids` before adding `new_requests` (a preempted
        request is forgotten and later sent whole again)."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.cfg.max_num_batched_tokens
        preempted = False
        speculate, self._next = self._speculates_next(), None

        # 1. Running requests, oldest first. Victims come from the tail, i.e. they have not been
        # scheduled yet this step (or are the current request itself).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            rid = req.request_id
            pending = req.num_output_placeholders
            num_new = min(req.num_tokens + pending - req.num_computed_tokens, budget)
            if num_new <= 0 or (pending and self._ends_within(req, pending)):
                i += 1  # nothing to compute until `update` gives it a token
                continue
            speculate_req = speculate and num_new == 1 and not pending
            drafts = (self.spec.drafts_for(req, self._drafts.get(rid),
                                           min(budget, self.max_len(req) - req.num_tokens) - 1)
                      if speculate_req else [])
            while True:
                new_ids = self.kv_manager.allocate_slots(req, num_new + len(drafts))
                if new_ids is not None:
                    break
                if drafts:  # short of memory: verify no drafts rather than preempt anyone
                    drafts = []
                    continue
                victim = self.running.pop()
                if victim is req and not self.running and self.kv_loads.holds_blocks:
                    self.running.append(req)  # the blocks it needs are being loaded into:
                    preempted = True  # it waits for those loads (no admission meanwhile)
                    break
                assert victim is not req or self.running, (
                    f"request {rid} alone cannot get blocks; the cache is too small"
                )
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            if new_ids is None:
                break  # `req` was preempted; it was the last running request
            if self.kv_loads.take_unsent(req):  # its KV came through the connector
                out.new_requests.append(NewRequestData.of(req, self.kv_manager.block_ids(rid)))
            else:
                out.cached_requests.append(CachedRequestData(
                    rid, new_ids, req.num_computed_tokens, self._num_freed_blocks.pop(rid, 0)))
            if drafts:
                out.spec_token_ids[rid] = drafts
                num_new += len(drafts)
            self._commit(req, num_new, out)
            budget -= num_new
            i += 1

        # 2. Waiting requests, FCFS. None after a preemption: memory is short this step.
        num_loading = len(self.kv_loads.loading)
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) + num_loading < self.cfg.max_num_seqs
        ):
            req = self.waiting[0]
            rid = req.request_id
            assert not req.num_output_placeholders  # a preempted request is updated first
            hits, num_hit = self.kv_manager.get_computed_blocks(req)
            if scores_prompt(req):
                hits, num_hit = [], 0  # every prompt token must be computed to be scored
            else:
                loading = self.kv_loads.admit(req, hits, num_hit)  # more prefix below the device?
                if loading is None:
                    break
                if loading:
                    self.waiting.popleft()
                    num_loading += 1
                    continue
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv_manager.allocate_slots(req, num_new, hits) is None:
                break  # FCFS: no one overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            out.new_requests.append(NewRequestData.of(req, self.kv_manager.block_ids(rid)))
            self._commit(req, num_new, out)
            budget -= num_new

        self.kv_loads.build(out)
        assert out.total_num_scheduled_tokens <= self.cfg.max_num_batched_tokens
        if self.structured is not None:
            self.structured.before_step(out)
        if self.spec is not None and out.total_num_scheduled_tokens:
            self.spec.scheduled(out, speculate)
            # The next step's mode, decided now: its drafts are proposed after this step.
            out.propose_drafts = self._speculates_next()
            out.feed_proposer = self._next[0]
        return out

    def _commit(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[req.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        req.num_computed_tokens += num_new
        if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += 1  # the step samples its next token

    def _ends_within(self, req: Request, n: int) -> bool:
        """Whether `n` more output tokens surely end the request (length limits only: a stop
        token cannot be foreseen)."""
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and req.num_output_tokens + n >= max_tokens:
            return True
        return req.num_tokens + n >= self.max_len(req)

    def _num_pending_tokens(self) -> int:
        """Tokens the next step would run without drafts (at most the budget); a token still
        being sampled (an output placeholder) counts as the decode it will be."""
        n = sum(r.num_tokens + r.num_output_placeholders - r.num_computed_tokens
                for r in self.running)
        for req in self.waiting:
            if n >= self.cfg.max_num_batched_tokens:
                break
            n += req.num_tokens
        return min(n, self.cfg.max_num_batched_tokens)

    def _forget_spec(self, req_id: str) -> None:
        self._constrained.discard(req_id)
        self._drafts.pop(req_id, None)
        self._num_freed_blocks.pop(req_id, None)
        if self.spec is not None:
            self.spec.forget(req_id)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front. Its computed full
        blocks stay in the prefix cache, so the recompute is often mostly hits."""
        self.kv_loads.release(req, preempted=True)
        self._drafts.pop(req.request_id, None)
        self._num_freed_blocks.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.finished_request_ids.add(req.request_id)

    # ---------------------------------------------------------------- update

    def update(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[StepOutput]:
        """Take the runner's sampled tokens: append them, cache newly full blocks, stop requests
        that are done. Returns one StepOutput per request that produced tokens or finished."""
        if self.structured is not None:
            self.structured.after_step(sched_out, runner_out)
        self.running += self.kv_loads.update(runner_out)  # requests whose KV arrived
        index = {rid: i for i, rid in enumerate(runner_out.req_ids)}
        outputs: list[StepOutput] = []
        finished: set[str] = set()
        for rid, (first, lps) in runner_out.prompt_logprobs.items():
            req = self.requests.get(rid)
            if req is not None:
                receive_prompt_logprobs(req, first, lps)
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted or finished since it was scheduled
            i = index.get(rid)
            sampled = runner_out.sampled_token_ids[i] if i is not None else []
            if sampled:
                req.num_output_placeholders -= 1
            if req.status is not RequestStatus.RUNNING:
                # Preempted after this step was scheduled (async scheduling): keep its token.
                outputs.extend(self._update_waiting(req, sampled, runner_out.logprobs, i))
                continue
            drafts = sched_out.spec_token_ids.get(rid)
            if drafts and sampled:
                # Give back the slots of rejected drafts: their KV belongs to no token.
                assert self.spec is not None
                num_accepted = len(sampled) - 1
                req.num_computed_tokens -= len(drafts) - num_accepted
                self.spec.observe(rid, len(drafts), num_accepted)
            elif sampled and self.spec is not None and self._drafts.get(rid):
                # A plain step (or depth 0): score the draft it did not verify.
                self.spec.observe_unverified(rid, self._drafts[rid][0] == sampled[0])
            if i is not None and i < len(runner_out.draft_token_ids):
                self._drafts[rid] = runner_out.draft_token_ids[i]
            if not sampled:
                # Mid-prefill: no logits were sampled. The step computed these tokens' KV: their
                # full blocks are now safe to share.
                self.kv_manager.cache_blocks(req, req.num_computed_tokens)
                continue
            # Several tokens only with speculative decoding; those past a stop are dropped.
            new_ids = append_until_stop(req, sampled, self.max_len(req))
            # After appending: accepted drafts are tokens now, and their blocks may be full.
            self.kv_manager.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            out = step_output(req, new_ids, runner_out.logprobs, i)
            if req.status.finished:
                self.kv_loads.release(req)
                self._forget_spec(rid)
                del self.requests[rid]
                finished.add(rid)
            elif drafts:
                # Blocks that held only rejected slots go back now (the next token's slot stays).
                freed = self.kv_manager.trim(req, req.num_computed_tokens + 1)
                if freed:
                    self._num_freed_blocks[rid] = self._num_freed_blocks.get(rid, 0) + freed
            outputs.append(out)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
            self._finished_ids |= finished
        return outputs

    def _update_waiting(
        self, req: Request, sampled: list[int],
        logprobs: list[list[TokenLogprobs] | None], i: int | None,
    ) -> list[StepOutput]:
        """Tokens of a step that ran before the request was preempted: they are its output
        (the recompute covers their KV); a stop among them ends it in the waiting queue."""
        if not sampled:
            return []
        new_ids = append_until_stop(req, sampled, self.max_len(req))
        out = step_output(req, new_ids, logprobs, i)
        if req.status.finished:
            self.waiting = deque(r for r in self.waiting if r is not req)
            self._forget_spec(req.request_id)
            del self.requests[req.request_id]
            self._finished_ids.add(req.request_id)
        return [out]

