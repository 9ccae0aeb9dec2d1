"""The scheduler's state between steps and its requests in and out: the waiting and running
queues, the KV cache manager, KV loads through a connector, the speculation policy; adding and
aborting requests, and what the engine asks between steps (`can_overlap`, `stats`). `Scheduler`
(step.py) adds the step."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from skyline.cache.connector import KVConnectorScheduler
from skyline.cache.kv_manager import KVCacheManager
from skyline.config import CacheConfig, SchedulerConfig, SpecConfig
from skyline.sched.headroom import Headroom
from skyline.sched.kv_loads import KVLoads
from skyline.sched.spec import SpecPolicy
from skyline.types import (
    Request,
    RequestStatus,
    SchedulerOutput,
)


class SchedulerQueues:
    """The requests the scheduler holds and the blocks they hold."""

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
        self.headroom = Headroom(cache_cfg.block_size, sched_cfg.schedule_conservativeness)
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
            "headroom_ratio": self.headroom.ratio,
        }

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache() + self.kv_loads.reset()

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
