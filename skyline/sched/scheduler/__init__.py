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

queues.py holds the scheduler's state and its requests in and out (`SchedulerQueues`: adding,
aborting, what the engine asks between steps); step.py the step itself (`Scheduler`:
`schedule`, preemption, `update`).
"""

from skyline.sched.scheduler.queues import SchedulerQueues
from skyline.sched.scheduler.step import Scheduler

__all__ = ["Scheduler", "SchedulerQueues"]
