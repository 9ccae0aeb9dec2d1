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

Whether a step speculates at all is measured, not modelled (`SpecGate`): a speculative step
runs synchronously and, on a GPU, without a CUDA graph, so it can cost more than the tokens it
saves even when most drafts are accepted. The engine times every step and the gate keeps, per
batch size (rounded up to a power of two), a decayed estimate of emitted tokens per second
with and without speculation; each step runs in the faster mode, and the slower one is
re-tested in short bursts, further apart (in time) each time it loses again, so that a
change of acceptance or of load is followed at a cost of a few percent of the time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from skyline.config import SpecConfig
from skyline.types import Request, SchedulerOutput

DECAY = 0.8  # weight of the past in the running acceptance
PRIOR = (1.0, 2.0)  # (accepted, tried) pseudo-counts: a new request starts at rate 0.5
PROBE_EVERY = 8

# The measured gate (SpecGate).
GATE_DECAY = 0.8  # weight of the past in a mode's tokens/s estimate, per measured step
# The speculative mode's steps emit 1..1 + depth tokens each, at the whim of acceptance: over
# GATE_DECAY's ~5-step memory their mean is too noisy to compare with plain decoding (which
# emits one per request per step) within a few percent; its rates remember ~20 steps.
GATE_SPEC_DECAY = 0.95
GATE_MIN_STEPS = 4  # measured steps of each mode before a bucket trusts its estimates
# Speculative-mode steps with nothing to verify do not count towards that; a mode that never
# has drafts (prompt lookup on chat) is judged after this many of them.
GATE_IDLE_STEPS = 4 * GATE_MIN_STEPS
# Weight of the past in the share of speculative-mode steps that had drafts to verify: slower
# than GATE_DECAY, a stretch of text with nothing to propose should not flip the mode.
GATE_SHARE_DECAY = 0.95
GATE_BURST = 4  # steps of one re-test of the losing mode
# A test of the speculative mode (exploration or re-test) also runs until its steps took as
# long as this many plain steps (at most GATE_TEST_MAX_STEPS steps): where a verification
# costs about a plain step (a CPU), four steps of 1..1 + depth tokens say too little, and
# more cost little; where it costs many plain steps, four already take longer.
GATE_TEST_PLAIN_STEPS = 16
GATE_TEST_MAX_STEPS = 32
# Re-tests are spaced in time, not steps (a speculative step can take 20 plain steps' time):
# the winner runs this many times the re-test's expected duration before one, so re-tests
# take at most 1/17 of the time at first; the factor doubles each time the loser loses again.
GATE_RETEST_FIRST = 16.0
GATE_RETEST_MAX = 1024.0
GATE_STALE = 0.5  # weight left to the loser's old estimate when a re-test starts
# Between re-tests the winner's (fresh) estimate must fall this far below the loser's (older)
# one to switch: noise alone should not flip the mode.
GATE_MARGIN = 0.05


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
            "spec_acceptance_rate": _ratio(self.num_accepted_tokens, self.num_draft_tokens),
            # tokens emitted per verification: the accepted drafts and the target's own token
            "spec_mean_accepted_length": (
                1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0
            ),
        }
        for j, (a, d) in enumerate(zip(self.accepted_by_pos, self.drafted_by_pos, strict=True)):
            s[f"spec_acceptance_pos_{j}"] = _ratio(a, d)
        s["spec_gate_steps"] = self.num_gate_steps
        s["spec_gate_speculated_fraction"] = _ratio(self.num_spec_steps, self.num_gate_steps)
        if self.gate is not None:
            s |= self.gate.stats()
        return s


@dataclass
class _Rate:
    """Decayed sums of one mode's measured steps in one bucket."""

    decay: float = GATE_DECAY  # weight of the past, per step
    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # decayed number of steps
    num_steps: int = 0
    total_s: float = 0.0  # all steps' seconds, not decayed

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds
        self.weight = self.decay * self.weight + 1
        self.num_steps += 1
        self.total_s += seconds

    def discount(self, factor: float) -> None:
        self.tokens *= factor
        self.seconds *= factor
        self.weight *= factor

    @property
    def per_s(self) -> float:
        return _ratio(self.tokens, self.seconds)

    @property
    def step_s(self) -> float:
        """Seconds per step."""
        return _ratio(self.seconds, self.weight)

    @property
    def step_tokens(self) -> float:
        """Tokens per step."""
        return _ratio(self.tokens, self.weight)


@dataclass
class _Bucket:
    """One batch-size bucket. The speculative mode is measured in two kinds of steps, those
    that verified drafts (`spec`) and those that had nothing to verify (`idle`: a request's
    first tokens, text no proposer guesses), mixed by the share of the first kind: its rate
    is what speculating costs and emits over such a mix."""

    plain: _Rate = field(default_factory=_Rate)
    spec: _Rate = field(default_factory=lambda: _Rate(GATE_SPEC_DECAY))
    idle: _Rate = field(default_factory=lambda: _Rate(GATE_SPEC_DECAY))
    share: float = 1.0  # decayed share of speculative-mode steps that verified drafts
    best: bool = True  # the winning mode: speculate or not
    measured: bool = False  # exploration over: best, re-tests and switches apply
    since_s: float = 0.0  # winning-mode seconds since the last re-test (or switch)
    period: float = GATE_RETEST_FIRST  # winning-mode time between re-tests, in re-test times
    testing: bool = False  # a re-test of the losing mode is running
    burst: int = 0  # re-test steps still to run at least
    burst_s: float = 0.0  # seconds of the re-test so far
    burst_steps: int = 0

    def add(self, speculated: bool, verified: bool, tokens: int, seconds: float) -> None:
        if not speculated:
            self.plain.add(tokens, seconds)
            return
        self.share = GATE_SHARE_DECAY * self.share + (1 - GATE_SHARE_DECAY) * verified
        (self.spec if verified else self.idle).add(tokens, seconds)

    def _mix(self, speculated: bool) -> tuple[float, float]:
        """(tokens, seconds) of a mean step of the mode."""
        if not speculated:
            return self.plain.step_tokens, self.plain.step_s
        f = self.share if self.idle.weight and self.spec.weight else float(self.spec.weight > 0)
        return (f * self.spec.step_tokens + (1 - f) * self.idle.step_tokens,
                f * self.spec.step_s + (1 - f) * self.idle.step_s)

    def per_s(self, speculated: bool) -> float:
        """The mode's estimated tokens per second."""
        return _ratio(*self._mix(speculated))

    def step_s(self, speculated: bool) -> float:
        return self._mix(speculated)[1]

    def discount(self, speculated: bool, factor: float) -> None:
        for r in (self.spec, self.idle) if speculated else (self.plain,):
            r.discount(factor)

    def explored(self, verified: bool, seconds: float, max_gain: float) -> bool:
        """Whether the exploration step just measured (`seconds` long) ends the exploration:
        both modes have GATE_MIN_STEPS steps (verifications for speculation, or
        GATE_IDLE_STEPS with nothing to verify), or a verification step took longer than the
        `max_gain` plain steps
        that would emit as many tokens as it can at most (1 + depth per request, every draft
        accepted), so that no acceptance can make it pay (on a GPU an eager verification step
        costs ~30 plain steps that run as CUDA graphs; four of them would be most of a
        short run's time). The criterion is the step's cost, not its tokens: a request's first
        drafts are often wrong, so one step's tokens say little, while its cost hardly depends
        on acceptance."""
        if self.plain.num_steps < GATE_MIN_STEPS:
            return False
        if self.idle.num_steps >= GATE_IDLE_STEPS or self.spec.num_steps >= GATE_TEST_MAX_STEPS:
            return True
        if (self.spec.num_steps >= GATE_MIN_STEPS
                and self.spec.total_s >= GATE_TEST_PLAIN_STEPS * self.plain.step_s):
            return True
        return verified and seconds > max_gain * self.plain.step_s

    def test_s(self, speculated: bool) -> float:
        """The expected length of a re-test of the mode (see GATE_TEST_PLAIN_STEPS)."""
        burst = GATE_BURST * self.step_s(speculated)
        return max(burst, GATE_TEST_PLAIN_STEPS * self.plain.step_s) if speculated else burst

    def test_done(self, speculated: bool) -> bool:
        """Whether the running re-test of the mode has run long enough."""
        if self.burst > 0:
            return False
        return (not speculated or self.burst_steps >= GATE_TEST_MAX_STEPS
                or self.burst_s >= GATE_TEST_PLAIN_STEPS * self.plain.step_s)


class SpecGate:
    """Speculate or not, per batch-size bucket, from measured tokens per second.

    `choose` answers for the next step; `observe` takes each measured step (pure-decode steps
    only: a prefill chunk's time says nothing about either mode). Until a bucket has
    GATE_MIN_STEPS steps of each mode it explores, plain steps first, and the speculative
    steps go on until they took GATE_TEST_PLAIN_STEPS plain steps' time (speculative-mode
    steps with nothing to verify count in the mode's rate, but only GATE_IDLE_STEPS of them
    end the exploration); a verification step slower than `max_gain` plain steps (it cannot
    pay at any acceptance) ends the exploration at once.
    Then it runs the mode with the higher estimate; once it has run `period` times as long as
    a re-test of the other mode takes (GATE_BURST steps, for speculation at least
    GATE_TEST_PLAIN_STEPS plain steps' time), it runs one, the other mode's old estimate
    discounted first, and switches if that mode is now faster. `period` starts at
    GATE_RETEST_FIRST and doubles (up to GATE_RETEST_MAX) each time the re-tested mode loses,
    so a mode that keeps losing costs a shrinking share of the time. The winner is measured
    all the time: if it becomes slower than the loser's estimate, the gate switches at once.
    Plain numbers only; the engine does the timing."""

    def __init__(self, max_gain: float = 1 << 30) -> None:
        # the most tokens a speculative step emits per token of a plain step: 1 + depth
        self.max_gain = max_gain
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(num_reqs: int) -> int:
        """The power of two at or above `num_reqs` (1 for an empty batch)."""
        return 1 << max(num_reqs - 1, 0).bit_length()

    def choose(self, num_reqs: int) -> bool:
        """Whether a step of `num_reqs` decoding requests should speculate."""
        b = self.buckets.get(self.bucket(num_reqs))
        if b is None or b.plain.num_steps < GATE_MIN_STEPS:
            return False
        if not b.measured:
            return True
        return b.best != b.testing

    def observe(self, num_reqs: int, speculated: bool, num_tokens: int, seconds: float,
                verified: bool = True) -> None:
        """A pure-decode step of `num_reqs` requests emitted `num_tokens` in `seconds`;
        `verified`: a speculative one had drafts to verify. One without is part of the
        mode's rate, but no measurement of verification for the exploration."""
        if seconds <= 0:
            return
        b = self.buckets.setdefault(self.bucket(num_reqs), _Bucket())
        b.add(speculated, verified, num_tokens, seconds)
        if not b.measured:
            if (b.explored(speculated and verified, seconds, self.max_gain)
                    or self._seed(self.bucket(num_reqs), b)):
                b.measured, b.best = True, b.per_s(True) > b.per_s(False)
            return
        if speculated != b.best:
            # A re-test step (or one chosen just before a switch).
            if b.testing:
                b.burst = max(b.burst - 1, 0)
                b.burst_s += seconds
                b.burst_steps += 1
                if b.test_done(speculated):
                    b.testing = False
                    if b.per_s(speculated) > b.per_s(b.best):
                        b.best, b.period = speculated, GATE_RETEST_FIRST
                    else:
                        b.period = min(2 * b.period, GATE_RETEST_MAX)
                    b.since_s = 0.0
            return
        b.since_s += seconds
        if b.per_s(b.best) < (1 - GATE_MARGIN) * b.per_s(not b.best):
            b.best, b.since_s, b.period = not b.best, 0.0, GATE_RETEST_FIRST
        elif b.since_s >= b.period * b.test_s(not b.best):
            b.discount(not b.best, GATE_STALE)
            b.testing, b.burst, b.since_s = True, GATE_BURST, 0.0
            b.burst_s, b.burst_steps = 0.0, 0

    def _seed(self, n: int, b: _Bucket) -> bool:
        """A new bucket `n` whose plain steps are measured, next to a bucket where a
        speculative step cost more than twice `max_gain` plain steps, takes that verdict
        instead of exploring: the neighbour's speculative step, scaled by the two buckets'
        plain steps (time and tokens), becomes its estimate; the re-tests correct it. A batch
        shrinking as its requests finish passes through every bucket below it, and an
        exploration step in each is what a short run on a GPU pays most."""
        if b.spec.num_steps or b.plain.num_steps < GATE_MIN_STEPS:
            return False
        for m in (n // 2, 2 * n):
            nb = self.buckets.get(m)
            if (nb is None or not nb.measured or nb.best or not nb.spec.weight
                    or nb.spec.step_s <= 2 * self.max_gain * nb.plain.step_s):
                continue
            time_ratio = b.plain.step_s / nb.plain.step_s
            token_ratio = b.plain.step_tokens / nb.plain.step_tokens
            b.spec.seconds = nb.spec.step_s * time_ratio
            b.spec.tokens = nb.spec.step_tokens * token_ratio
            b.spec.weight = 1.0
            return True
        return False

    def stats(self) -> dict[str, float]:
        """Per bucket: both estimates (tokens/s) and the mode in use (1: speculate)."""
        s: dict[str, float] = {}
        for n, b in sorted(self.buckets.items()):
            s[f"spec_gate_b{n}_spec_tokens_per_s"] = b.per_s(True)
            s[f"spec_gate_b{n}_plain_tokens_per_s"] = b.per_s(False)
            s[f"spec_gate_b{n}_speculating"] = float(b.best if b.measured else True)
        return s


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
