"""The engine core: one loop of schedule -> execute -> update.

With async scheduling (the default on CUDA) the loop runs one step ahead: it schedules and
launches step n+1, then updates the scheduler with step n, whose tokens arrive while the device
runs n+1. The host's work per step (scheduling, input preparation, detokenizing, the server)
then overlaps the device's instead of adding to it. See sched/scheduler/ for what the
scheduler does meanwhile, and worker/runner/ for how the tokens flow on the device.

Each step is timed for the speculation gate (sched/spec/gate.py): from its scheduling, or from the
previous step's outputs if they came later (async scheduling: the time between consecutive
outputs), to its own outputs. The time the caller spends between `step` calls is not counted
for a synchronous step; with async scheduling it is, as it overlaps the device's work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from skyline.cache.connector import KVConnectorScheduler
from skyline.cache.offload import TierConnector, TierLayout
from skyline.cache.pd import PDConnector
from skyline.config import ConfigError, EngineConfig
from skyline.engine.gc_tuning import GC_THRESHOLD0, fewer_collections, tune_gc  # noqa: F401
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, RunnerOutput, SchedulerOutput, StepOutput
from skyline.worker.executor import make_executor

log = logging.getLogger(__name__)


class StepObserver(Protocol):
    """Told of every updated step: its scheduler output, when it was scheduled (monotonic
    seconds) and how long it took (see the module docstring)."""

    def __call__(self, out: SchedulerOutput, scheduled_at: float, seconds: float) -> None: ...


class EngineCore:
    """The loop's state: a scheduler (bookkeeping), an executor (compute) and the step in
    flight. `structured` (engine/frontend/structured.py) constrains requests that ask for it;
    `observers` are told of every step."""

    def __init__(self, config: EngineConfig, max_model_len_auto: bool = False,
                 structured: Any = None, observers: Sequence[StepObserver] = ()) -> None:
        self.executor = make_executor(config)
        capacity = self.executor.num_blocks * config.cache.block_size
        if capacity < config.scheduler.max_model_len:
            if not max_model_len_auto:
                self.executor.shutdown()
                raise ConfigError(
                    f"the KV cache holds {capacity} tokens, fewer than --max-model-len "
                    f"{config.scheduler.max_model_len}; give it more memory "
                    "(--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len"
                )
            log.warning("max_model_len lowered to %d to fit the KV cache", capacity)
            sched = dataclasses.replace(config.scheduler, max_model_len=capacity)
            model = dataclasses.replace(config.model, max_model_len=capacity)
            config = dataclasses.replace(config, scheduler=sched, model=model)
        if config.scheduler.max_num_seqs_auto:  # the runner chose it from the cache's size
            sched = dataclasses.replace(config.scheduler,
                                        max_num_seqs=self.executor.max_num_seqs)
            config = dataclasses.replace(config, scheduler=sched)
        self.config = config
        self.structured = structured
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks,
                                   config.spec, structured, self._connector(config))
        self.observers = tuple(observers)
        self.async_scheduling = config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, float] | None = None  # launched, not updated
        self._last_output_t = 0.0  # when the last step's outputs were ready

    def _connector(self, config: EngineConfig) -> KVConnectorScheduler | None:
        """The scheduler's half of the KV connector, sized by what the workers hold."""
        info = self.kv_connector_info = self.executor.query("kv_connector_info")
        if info is None:
            return None
        if config.fleet.role != "both":
            return PDConnector(config.fleet.role, config.cache.block_size,
                               info.get("payload_bytes", 0))
        layout = TierLayout(info["ram_slots"], info["disk_blocks"], info["disk_writable"],
                            tuple(info["disk_found"]), info["ram_is_buffer"])
        sc = config.scheduler
        # RAM slots kept free for the stores of about two steps' evictions.
        headroom = 2 * (sc.max_num_batched_tokens // config.cache.block_size + sc.max_num_seqs)
        return TierConnector(layout, config.cache.block_size,
                             config.offload.policy == "eager", headroom)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def add_request(self, req: Request) -> None:
        req.max_model_len = self.max_model_len
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens but the context length is "
                f"{self.max_model_len}; shorten the prompt"
            )
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.config.model.arch.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        if self.structured is not None:
            self.structured.admit(req.sampling_params)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[StepOutput]:
        """One step: schedule, execute, update. With async scheduling, see `_step_overlapped`."""
        if self.async_scheduling:
            return self._step_overlapped()
        outputs: list[StepOutput] = []
        if self._in_flight is not None:  # async scheduling was switched off meanwhile
            outputs += self._update(*self._in_flight, self.executor.collect())
            self._in_flight = None
        t = time.monotonic()
        out = self.scheduler.schedule()
        res = self.executor.execute(out)
        return outputs + self._update(out, t, res)

    def _step_overlapped(self) -> list[StepOutput]:
        """Schedule and launch step n+1, then update the scheduler with step n, whose tokens
        the device produced meanwhile. Where the next step cannot be scheduled before the last
        one's tokens are known (`Scheduler.can_overlap`: drafts to verify, constraints to
        apply), the step in flight is collected first and the new one runs synchronously."""
        outputs: list[StepOutput] = []
        overlap = self.scheduler.can_overlap()
        if self._in_flight is not None and not overlap:
            outputs += self._update(*self._in_flight, self.executor.collect())
            self._in_flight = None
        t = time.monotonic()
        out = self.scheduler.schedule()
        prev = self.executor.launch(out)
        if self._in_flight is not None:
            assert prev is not None
            outputs += self._update(*self._in_flight, prev)
            self._in_flight = None
        if out.empty:
            return outputs  # nothing launched (the runner only dropped finished requests)
        if overlap:
            self._in_flight = (out, t)
        else:
            outputs += self._update(out, t, self.executor.collect())
        return outputs

    def _update(self, out: SchedulerOutput, scheduled_at: float,
                res: RunnerOutput) -> list[StepOutput]:
        """Update the scheduler with a step's tokens and report the step's time."""
        if out.empty:
            return []  # nothing ran (the runner only dropped finished requests)
        outputs = self.scheduler.update(out, res)
        if not out.total_num_scheduled_tokens:
            return outputs  # only KV transfers: no step to time
        now = time.monotonic()
        seconds = now - max(scheduled_at, self._last_output_t)
        self._last_output_t = now
        self.scheduler.record_step(out, sum(len(o.new_token_ids) for o in outputs), seconds)
        for observe in self.observers:
            observe(out, scheduled_at, seconds)
        return outputs

    def stats(self) -> dict[str, float]:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
