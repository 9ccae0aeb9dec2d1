"""Speculative decoding, the scheduler's side: how many draft tokens each request may verify
this step, and the acceptance metrics. Plain Python; the proposals come from the runner.

Depth adapts per request to its running acceptance: with a per-token acceptance rate a, the
j-th draft is kept with probability about a**j, so drafts are verified only while that beats
their cost (a**j > `SpecConfig.draft_cost`, the price of one more query token relative to a
decode step and of the proposer's work for it). A request whose acceptance earns no draft still
verifies one every PROBE_EVERY steps, so a rate that recovers is noticed; and in a step where a
request verifies nothing, its first draft is still scored against the token the step sampled
(`observe_unverified`), so the rate stays current while the gate runs plain steps. (For a
sampled token that match has the probability of accepting the draft.) A step whose batch is
already large is compute-bound: extra query tokens cost about as much as the tokens they might
save, so it does not speculate (`SpecConfig.max_batch_tokens`, an upper bound).
"""

from __future__ import annotations

from collections import deque

from skyline.config import SpecConfig
from skyline.sched.spec.gate import SpecGate, ratio
from skyline.types import Request, SchedulerOutput

DECAY = 0.8  # weight of the past in the running acceptance
PRIOR = (1.0, 2.0)  # (accepted, tried) pseudo-counts: a new request starts at rate 0.5
PROBE_EVERY = 8


class SpecPolicy:
    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self._rate: dict[str, tuple[float, float]] = {}  # req id -> decayed (accepted, tried)
        self._idle: dict[str, int] = {}  # req id -> steps since its last verification
        self.num_steps = 0  # verifications: (request, step) pairs with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        k = cfg.num_speculative_tokens
        self.accepted_by_pos = [0] * k
        self.drafted_by_pos = [0] * k
        self.gate = SpecGate(1 + k) if cfg.gate else None
        self.num_gate_steps = 0  # steps decided by `speculates`
        self.num_spec_steps = 0  # of which speculative
        # Steps scheduled but not yet recorded, with whether each speculated (at most two are
        # outstanding with async scheduling; bounded for callers that never record).
        self._step_modes: deque[tuple[SchedulerOutput, bool]] = deque(maxlen=4)

    def enabled(self, num_batch_tokens: int) -> bool:
        """Whether a step whose batch holds `num_batch_tokens` tokens before drafts may
        speculate at all (the static upper bound)."""
        return num_batch_tokens <= self.cfg.max_batch_tokens

    def speculates(self, num_batch_tokens: int, num_reqs: int) -> bool:
        """Whether the next step speculates: within the static bound, and in the mode the gate
        measured faster for `num_reqs` running requests."""
        on = self.enabled(num_batch_tokens) and (
            self.gate is None or self.gate.choose(num_reqs))
        self.num_gate_steps += 1
        self.num_spec_steps += on
        return on

    def scheduled(self, out: SchedulerOutput, speculated: bool) -> None:
        """A step was scheduled in mode `speculated`; its timing comes in `record_step`."""
        self._step_modes.append((out, speculated))

    def record_step(self, out: SchedulerOutput, num_tokens: int, seconds: float) -> None:
        """The engine's timing of a scheduled step: it emitted `num_tokens` tokens in `seconds`
        of wall time. Only steps whose every token is a decode or a verification feed the
        gate: a prefill chunk's cost would be charged to whichever mode ran it. A step of the
        speculative mode in which no request had a draft is still that mode's cost (it runs
        synchronously, and the proposer runs: on a GPU several plain steps' time), but not a
        verification: the gate counts its time and tokens for the mode without letting it end
        the exploration (`SpecGate.observe`). As a plain step it would make plain decoding look
        as slow as speculating with nothing to propose."""
        speculated = None
        for i, (o, mode) in enumerate(self._step_modes):
            if o is out:
                speculated = mode
                del self._step_modes[i]
                break
        if speculated is None or out.new_requests:
            return
        n = out.num_scheduled_tokens
        drafts = out.spec_token_ids
        if not n or any(k != 1 + len(drafts.get(rid, ())) for rid, k in n.items()):
            return
        self.observe_step(len(n), speculated, num_tokens, seconds, bool(drafts))

    def observe_step(self, num_reqs: int, speculated: bool, num_tokens: int,
                     seconds: float, verified: bool = True) -> None:
        """A step of `num_reqs` decoding requests (no prefill in it), run in the mode
        `speculated`, emitted `num_tokens` tokens in `seconds` of wall time; `verified`:
        some request verified drafts in it."""
        if self.gate is not None:
            self.gate.observe(num_reqs, speculated, num_tokens, seconds, verified)

    def drafts_for(self, req: Request, drafts: list[int] | None, limit: int) -> list[int]:
        """The drafts a decoding request verifies this step: as deep as its acceptance earns,
        at most `limit` (the step's budget less its own token, and the context), and within
        the tokens it may still emit (a step emits at most one token more than it verifies)."""
        params = req.sampling_params
        if not drafts or params.json_schema or params.regex or params.grammar:
            return []  # constrained decoding masks one position per step
        k = min(len(drafts), self.depth(req.request_id), limit)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - req.num_output_tokens - 1)
        return drafts[: max(k, 0)]

    def depth(self, req_id: str) -> int:
        """How many drafts the request may verify now (0: decode plainly this step)."""
        acc, tried = self._rate.get(req_id, PRIOR)
        rate = acc / tried
        depth, gain = 0, rate
        while depth < self.cfg.num_speculative_tokens and gain > self.cfg.draft_cost:
            depth += 1
            gain *= rate
        if depth == 0:
            idle = self._idle.get(req_id, 0) + 1
            self._idle[req_id] = idle
            if idle >= PROBE_EVERY:
                depth = 1
        return depth

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` drafts kept the first `num_accepted`."""
        self._idle.pop(req_id, None)
        acc, tried = self._rate.get(req_id, PRIOR)
        # Drafts after the first rejection were never really tried.
        tried_now = num_accepted + (num_accepted < num_drafts)
        self._rate[req_id] = (DECAY * acc + num_accepted, DECAY * tried + tried_now)
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.drafted_by_pos[j] += 1
            self.accepted_by_pos[j] += j < num_accepted

    def observe_unverified(self, req_id: str, hit: bool) -> None:
        """A step sampled the request's next token without verifying drafts; `hit`: its first
        draft was that token. Feeds the running acceptance only, not the metrics."""
        acc, tried = self._rate.get(req_id, PRIOR)
        self._rate[req_id] = (DECAY * acc + hit, DECAY * tried + 1)

    def forget(self, req_id: str) -> None:
        self._rate.pop(req_id, None)
        self._idle.pop(req_id, None)

    def stats(self) -> dict[str, float]:
        s = {
            "spec_num_verifications": self.num_steps,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": ratio(self.num_accepted_tokens, self.num_draft_tokens),
            # tokens emitted per verification: the accepted drafts and the target's own token
            "spec_mean_accepted_length": (
                1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0
            ),
        }
        for j, (a, d) in enumerate(zip(self.accepted_by_pos, self.drafted_by_pos, strict=True)):
            s[f"spec_acceptance_pos_{j}"] = ratio(a, d)
        s["spec_gate_steps"] = self.num_gate_steps
        s["spec_gate_speculated_fraction"] = ratio(self.num_spec_steps, self.num_gate_steps)
        if self.gate is not None:
            s |= self.gate.stats()
        return s
