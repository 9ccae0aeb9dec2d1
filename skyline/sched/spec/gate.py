"""The measured gate: speculate or not, per batch size.

Whether a step speculates at all is measured, not modelled (`SpecGate`): a speculative step
runs synchronously and, on a GPU, without a CUDA graph, so it can cost more than the tokens it
saves even when most drafts are accepted. The engine times every step and the gate keeps, per
batch size (rounded up to a power of two), a decayed estimate of emitted tokens per second
with and without speculation; each step runs in the faster mode, and the slower one is
re-tested in short bursts, further apart (in time) each time it loses again, so that a
change of acceptance or of load is followed at a cost of a few percent of the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        return ratio(self.tokens, self.seconds)

    @property
    def step_s(self) -> float:
        """Seconds per step."""
        return ratio(self.seconds, self.weight)

    @property
    def step_tokens(self) -> float:
        """Tokens per step."""
        return ratio(self.tokens, self.weight)


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
    burst_steps: int = 0  # steps of the re-test so far
    burst_s: float = 0.0  # and their seconds

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
        return ratio(*self._mix(speculated))

    def step_s(self, speculated: bool) -> float:
        return self._mix(speculated)[1]

    def discount(self, speculated: bool, factor: float) -> None:
        for r in (self.spec, self.idle) if speculated else (self.plain,):
            r.discount(factor)

    def explored(self, verified: bool, seconds: float, max_gain: float) -> bool:
        """Whether the exploration step just measured (`seconds` long) ends the exploration:
        the plain mode has GATE_MIN_STEPS steps and the speculative one a whole test (`_tested`;
        or GATE_IDLE_STEPS with nothing to verify), or a verification step took longer than
        the `max_gain` plain steps that would emit as many tokens as it can at most (1 + depth
        per request, every draft accepted), so that no acceptance can make it pay (on a GPU an
        eager verification step costs ~30 plain steps that run as CUDA graphs; four of them
        would be most of a short run's time). The criterion is the step's cost, not its
        tokens: a request's first drafts are often wrong, so one step's tokens say little,
        while its cost hardly depends on acceptance."""
        if self.plain.num_steps < GATE_MIN_STEPS:
            return False
        if (self.idle.num_steps >= GATE_IDLE_STEPS
                or self._tested(self.spec.num_steps, self.spec.total_s, GATE_MIN_STEPS)):
            return True
        return verified and seconds > max_gain * self.plain.step_s

    def _tested(self, steps: int, seconds: float, min_steps: int) -> bool:
        """Whether `steps` speculative steps of `seconds` make a whole test of speculation
        (see GATE_TEST_PLAIN_STEPS)."""
        return steps >= GATE_TEST_MAX_STEPS or (
            steps >= min_steps and seconds >= GATE_TEST_PLAIN_STEPS * self.plain.step_s)

    def test_s(self, speculated: bool) -> float:
        """The expected length of a re-test of the mode (see GATE_TEST_PLAIN_STEPS)."""
        burst = GATE_BURST * self.step_s(speculated)
        return max(burst, GATE_TEST_PLAIN_STEPS * self.plain.step_s) if speculated else burst

    def test_done(self, speculated: bool) -> bool:
        """Whether the running re-test of the mode has run long enough."""
        if not speculated:
            return self.burst_steps >= GATE_BURST
        return self._tested(self.burst_steps, self.burst_s, GATE_BURST)


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
                b.burst_steps += 1
                b.burst_s += seconds
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
            b.testing, b.since_s, b.burst_steps, b.burst_s = True, 0.0, 0, 0.0

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


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
