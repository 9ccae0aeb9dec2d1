"""A scheduler step: `schedule` spends the token budget on running then waiting requests
(allocating their blocks, preempting by recompute when short), `update` takes the runner's
tokens and finishes requests (the package's docstring has the invariants and the call order)."""

from __future__ import annotations

from collections import deque

from skyline.sched.scheduler.queues import SchedulerQueues
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


class Scheduler(SchedulerQueues):
    """Decides, every step, which requests run and how many tokens each."""

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts; allocate their blocks.

        The runner must drop `finished_request_ids` before adding `new_requests` (a preempted
        request is forgotten and later sent whole again)."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.cfg.max_num_batched_tokens
        preempted = False
        preemptions = self.num_preemptions
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

        if self.num_preemptions > preemptions:
            self.headroom.preempted()

        # 2. Waiting requests, FCFS. None after a preemption: memory is short this step. Each
        # is admitted only while the free blocks cover what the running ones (and it) are
        # expected to add (sched/headroom.py).
        num_loading = len(self.kv_loads.loading)
        reserve = 0  # blocks held back for the running (and admitted) requests
        plan = None  # whether admissions keep the headroom, decided at the first candidate
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
            keep = 0  # free blocks this admission must leave
            if plan is None and self.headroom.enabled:
                reserve = self.headroom.reserved(self.running, self.kv_manager.blocks,
                                                 self.max_len)
                # the last of the queue starts at once when holding it back would only leave
                # it a tail of its own
                plan = not self.headroom.start_all(
                    self.running, self.waiting, self.kv_manager.blocks, self.max_len,
                    self.kv_manager.num_free_blocks, reserve)
            if plan:
                keep = reserve + self.headroom.future_blocks(
                    req, -(-(num_hit + num_new) // self.block_size), self.max_len(req))
            if self.kv_manager.allocate_slots(req, num_new, hits, keep) is None:
                break  # FCFS: no one overtakes the head of the queue
            if plan:
                reserve = keep  # it runs now: its own expected blocks are held back too
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
                self.headroom.finished(req, self.max_len(req))
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
            self.headroom.finished(req, self.max_len(req))
            self.waiting = deque(r for r in self.waiting if r is not req)
            self._forget_spec(req.request_id)
            del self.requests[req.request_id]
            self._finished_ids.add(req.request_id)
        return [out]
