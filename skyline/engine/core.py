"""The engine core: one loop of schedule -> execute -> update.

With async scheduling (the default on CUDA) the loop runs one step ahead: it schedules and
launches step n+1, then updates the scheduler with step n, whose tokens arrive while the device
runs n+1. The host's work per step (scheduling, input preparation, detokenizing, the server)
then overlaps the device's instead of adding to it. See sched/scheduler.py for what the
scheduler does meanwhile, and worker/runner.py for how the tokens flow on the device.

Each step is timed for the speculation gate (sched/spec/gate.py): from its scheduling, or from the
previous step's outputs if they came later (async scheduling: the time between consecutive
outputs), to its own outputs. The time the caller spends between `step` calls is not counted
for a synchronous step; with async scheduling it is, as it overlaps the device's work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator

from skyline.config import ConfigError, EngineConfig
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, RunnerOutput, SchedulerOutput, StepOutput
from skyline.worker.executor import Executor

log = logging.getLogger(__name__)

# Net allocations of container objects between young-generation collections (CPython's
# default is 700). A step at a thousand requests allocates a few thousand short-lived
# containers and frees them before the next: with the default, collections run several times
# a step, and every few dozen steps a full one rescans each request's token lists: a pause the
# device waits out (bench/host_overhead.py times them).
GC_THRESHOLD0 = 20_000


def tune_gc() -> None:
    """For a process that runs an engine loop, once the engine is built: freeze what exists
    (the model, the tokenizer, the modules: nothing to collect, much to scan) and collect the
    young generation less often. Reference counting still frees everything acyclic at once."""
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(GC_THRESHOLD0, g0), g1, g2)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """`tune_gc`'s threshold for a while, in a process that is not the engine's own (the
    offline `LLM` runs in the caller's): restored afterwards, nothing frozen."""
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(GC_THRESHOLD0, g0), g1, g2)
    try:
        yield
    finally:
        gc.set_threshold(g0, g1, g2)


class EngineCore:
    def __init__(self, config: EngineConfig, max_model_len_auto: bool = False) -> None:
        self.executor = Executor(config)
        capacity = self.executor.num_blocks * config.cache.block_size
        if capacity < config.scheduler.max_model_len:
            if not max_model_len_auto:
                raise ConfigError(
                    f"the KV cache holds {capacity} tokens, fewer than --max-model-len "
                    f"{config.scheduler.max_model_len}; give it more memory "
                    "(--kv-cache-memory / --gpu-memory-utilization) or lower --max-model-len"
                )
            log.warning("max_model_len lowered to %d to fit the KV cache", capacity)
            sched = dataclasses.replace(config.scheduler, max_model_len=capacity)
            model = dataclasses.replace(config.model, max_model_len=capacity)
            config = dataclasses.replace(config, scheduler=sched, model=model)
        self.config = config
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks,
                                   config.spec)
        self.async_scheduling = config.async_scheduling
        self._in_flight: SchedulerOutput | None = None  # launched, not yet updated
        self._in_flight_t = 0.0  # when the step in flight was scheduled
        self._last_output_t = 0.0  # when the last step's outputs were ready
        # Called with each updated step and its seconds (benchmarks trace where time goes).
        self.step_observers: list[Callable[[SchedulerOutput, float], None]] = []

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
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        overlap = self.async_scheduling and self.scheduler.can_overlap()
        if self._in_flight is not None and not overlap:
            outputs += self._update(self._in_flight, self._in_flight_t, self.executor.collect())
            self._in_flight = None
        t = time.perf_counter()
        out = self.scheduler.schedule()
        prev = self.executor.launch(out)
        if self._in_flight is not None:
            assert prev is not None
            outputs += self._update(self._in_flight, self._in_flight_t, prev)
            self._in_flight = None
        if out.empty:
            return outputs  # nothing launched (the runner only dropped finished requests)
        if overlap:
            self._in_flight, self._in_flight_t = out, t
        else:
            outputs += self._update(out, t, self.executor.collect())
        return outputs

    def _update(self, out: SchedulerOutput, scheduled_t: float,
                res: RunnerOutput) -> list[StepOutput]:
        """Update the scheduler with a step's tokens and report the step's time."""
        outputs = self.scheduler.update(out, res)
        now = time.perf_counter()
        seconds = now - max(scheduled_t, self._last_output_t)
        self._last_output_t = now
        self.scheduler.record_step(out, sum(len(o.new_token_ids) for o in outputs), seconds)
        for observe in self.step_observers:
            observe(out, seconds)
        return outputs

    def stats(self) -> dict[str, float]:
        return self.scheduler.stats()
