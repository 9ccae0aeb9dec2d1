"""The measured speculation gate (sched/spec.py) against a fake clock: it explores both modes,
settles on the faster one per batch-size bucket, re-tests the loser ever more rarely, follows
a change of costs, and only pure-decode steps reach it from the scheduler."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from skyline.config import CacheConfig, SchedulerConfig, SpecConfig
from skyline.sched.scheduler import Scheduler
from skyline.sched.spec import SpecGate, SpecPolicy
from skyline.sched.spec.gate import (
    GATE_BURST,
    GATE_IDLE_STEPS,
    GATE_MIN_STEPS,
    GATE_RETEST_FIRST,
    GATE_RETEST_MAX,
    GATE_TEST_PLAIN_STEPS,
)
from skyline.types import Request, RunnerOutput, SamplingParams


def _run(gate: SpecGate, num_steps: int, cost, num_reqs: int = 8,
         times: list[float] | None = None) -> list[bool]:
    """Drive the gate with a fake clock: `cost(step, speculated)` gives (tokens, seconds)."""
    modes = []
    for i in range(num_steps):
        spec = gate.choose(num_reqs)
        tokens, seconds = cost(i, spec)
        gate.observe(num_reqs, spec, tokens, seconds)
        modes.append(spec)
        if times is not None:
            times.append(seconds)
    return modes


def _fixed(spec_tok_s: float, plain_tok_s: float):
    # a speculative step emits 3 tokens, a plain one 1
    return lambda i, spec: (3, 3 / spec_tok_s) if spec else (1, 1 / plain_tok_s)


def test_bucket_is_the_next_power_of_two():
    assert [SpecGate.bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 32, 33)] == \
        [1, 1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_explores_plain_then_speculation():
    modes = _run(SpecGate(), 2 * GATE_MIN_STEPS + 1, _fixed(10, 20))
    assert modes == [False] * GATE_MIN_STEPS + [True] * GATE_MIN_STEPS + [False]


def test_a_hopeless_speculative_step_ends_the_exploration():
    # depth 3: a speculative step emits at most 4 tokens per plain step's token. One that
    # costs 5 plain steps cannot pay at any acceptance (a GPU's eager verification step
    # against CUDA-graph plain steps): the exploration ends there, the first re-test comes
    # much later.
    gate = SpecGate(max_gain=4)
    modes = _run(gate, 200, lambda i, spec: (4, 5.0) if spec else (1, 1.0))
    assert modes[:GATE_MIN_STEPS + 2] == [False] * GATE_MIN_STEPS + [True, False]
    assert gate.buckets[8].measured and not gate.buckets[8].best
    assert sum(modes) == 1
    # a slow rate alone is not hopeless: the first drafts of a request are often wrong
    gate = SpecGate(max_gain=4)
    modes = _run(gate, 2 * GATE_MIN_STEPS, lambda i, spec: (1, 3.0) if spec else (1, 1.0))
    assert modes == [False] * GATE_MIN_STEPS + [True] * GATE_MIN_STEPS


def test_cheap_verification_is_explored_long_enough_to_see_its_yield():
    # A CPU: a verification step costs 1.2 plain steps. A request's first drafts are wrong
    # (one token per step), later ones are right half the time (1 or 3 tokens: 1.67x plain).
    # Four steps would condemn speculation; the test runs for GATE_TEST_PLAIN_STEPS plain
    # steps' time instead.
    seen = {"spec": 0}

    def cost(i, spec):
        if not spec:
            return 1, 1.0
        seen["spec"] += 1
        k = seen["spec"]
        return (1 if k <= GATE_MIN_STEPS or k % 2 else 3), 1.2

    gate = SpecGate(max_gain=9)
    test_steps = math.ceil(GATE_TEST_PLAIN_STEPS / 1.2)  # 14 steps of 1.2 plain steps
    modes = _run(gate, GATE_MIN_STEPS + test_steps - 1, cost, num_reqs=1)
    assert not gate.buckets[1].measured and all(modes[GATE_MIN_STEPS:])
    modes = _run(gate, 400, cost, num_reqs=1)
    assert gate.buckets[1].measured and gate.buckets[1].best and sum(modes[-100:]) > 90
    # where a verification costs 6 plain steps, four of them are the whole test
    gate = SpecGate(max_gain=9)
    modes = _run(gate, 2 * GATE_MIN_STEPS + 1, lambda i, spec: (1, 6.0) if spec else (1, 1.0),
                 num_reqs=1)
    assert modes == [False] * GATE_MIN_STEPS + [True] * GATE_MIN_STEPS + [False]


@pytest.mark.parametrize("spec_faster", [True, False])
def test_chooses_the_faster_mode_and_exploration_time_stays_small(spec_faster):
    gate = SpecGate()
    # a speculative step takes 6x (spec slower) or 2x (spec faster) a plain step's time
    cost = _fixed(30, 20) if spec_faster else _fixed(10, 20)
    times: list[float] = []
    modes = _run(gate, 6000, cost, times=times)
    k = 2 * GATE_MIN_STEPS
    wrong = sum(t for m, t in zip(modes[k:], times[k:], strict=True) if m != spec_faster)
    assert 0 < wrong / sum(times[k:]) < 0.03  # the loser is re-tested, rarely
    s = gate.stats()
    assert s["spec_gate_b8_speculating"] == float(spec_faster)
    assert s["spec_gate_b8_spec_tokens_per_s"] == pytest.approx(30 if spec_faster else 10)
    assert s["spec_gate_b8_plain_tokens_per_s"] == pytest.approx(20)


@pytest.mark.parametrize("spec_faster", [True, False])
def test_retests_come_in_bursts_ever_further_apart_in_time(spec_faster):
    cost = _fixed(30, 20) if spec_faster else _fixed(10, 20)
    times: list[float] = []
    modes = _run(SpecGate(), 20000, cost, times=times)
    loser_step_s = cost(0, not spec_faster)[1]
    bursts = [i for i in range(2 * GATE_MIN_STEPS, len(modes))
              if modes[i] != spec_faster and modes[i - 1] == spec_faster]
    assert len(bursts) >= 4
    for start in bursts:
        assert modes[start:start + GATE_BURST + 1] == [not spec_faster] * GATE_BURST + \
            [spec_faster]
    for k, (a, b) in enumerate(itertools.pairwise(bursts)):
        gap = sum(times[a + GATE_BURST : b])  # winner time between two re-tests
        period = min(GATE_RETEST_FIRST * 2 ** (k + 1), GATE_RETEST_MAX)
        expected = period * GATE_BURST * loser_step_s
        assert expected <= gap < expected + cost(0, spec_faster)[1] + 1e-9


def test_follows_a_change_of_costs():
    gate = SpecGate()
    phase = {"spec_tok_s": 40.0}

    def cost(i, spec):
        return (3, 3 / phase["spec_tok_s"]) if spec else (1, 1 / 20)

    _run(gate, 1000, cost)
    assert gate.buckets[8].best  # speculation wins (40 vs 20 tokens/s)
    phase["spec_tok_s"] = 8.0  # acceptance collapses: the winner's own steps show it soon
    modes = _run(gate, 40, cost)
    # (the speculative rate remembers ~20 steps: seven at 8 tokens/s bring it below 19)
    assert modes.index(False) <= 8 and not any(modes[12:])
    phase["spec_tok_s"] = 60.0  # acceptance recovers: the next re-test finds it
    modes = _run(gate, 2000, cost)
    first = modes.index(True)
    # the re-test comes after the plain winner ran GATE_RETEST_FIRST bursts' time
    # (a speculative step was last measured at 3 / 8 s, a plain one takes 1 / 20 s)
    assert first <= GATE_RETEST_FIRST * GATE_BURST * (3 / 8) * 20 + 1
    assert all(modes[first:first + 50]) and gate.buckets[8].best


def test_noisy_clock_still_picks_the_faster_mode():
    rng = random.Random(0)
    base = _fixed(26, 20)  # speculation 30% faster, each step's time off by up to +-40%

    def cost(i, spec):
        tokens, seconds = base(i, spec)
        return tokens, seconds * rng.uniform(0.6, 1.4)

    modes = _run(SpecGate(), 3000, cost)
    assert sum(modes[500:]) / len(modes[500:]) > 0.9


def test_buckets_are_independent():
    gate = SpecGate()
    for _ in range(500):
        for n, (spec_s, plain_s) in ((1, (30, 10)), (32, (100, 300))):
            spec = gate.choose(n)
            gate.observe(n, spec, *_fixed(spec_s, plain_s)(0, spec))
    assert gate.choose(1) is True and gate.choose(32) is False
    assert gate.choose(3) is False  # bucket 4: never measured, explores plain steps first


def test_policy_static_bound_and_gate_off():
    cfg = SpecConfig(method="ngram", max_batch_tokens=16)
    policy = SpecPolicy(cfg)
    assert not policy.speculates(17, 17)  # above the static bound, whatever the gate says
    for _ in range(3 * GATE_MIN_STEPS):
        spec = policy.speculates(8, 8)
        policy.observe_step(8, spec, *_fixed(12, 20)(0, spec))
    assert not policy.speculates(8, 8)
    s = policy.stats()
    assert s["spec_gate_steps"] == 3 * GATE_MIN_STEPS + 2
    assert s["spec_gate_speculated_fraction"] == pytest.approx(
        GATE_MIN_STEPS / (3 * GATE_MIN_STEPS + 2))
    ungated = SpecPolicy(SpecConfig(method="ngram", gate=False))
    for _ in range(20):
        assert ungated.speculates(8, 8)
        ungated.observe_step(8, True, 1, 10.0)
    assert ungated.gate is None and "spec_gate_b8_speculating" not in ungated.stats()


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=256),
                     CacheConfig(block_size=4), 64,
                     SpecConfig(method="ngram", num_speculative_tokens=3, max_batch_tokens=64,
                                draft_cost=0.0))


def _request(rid: str) -> Request:
    return Request(rid, [3, 4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=50,
                                                         ignore_eos=True))


def test_scheduler_feeds_only_decode_steps_and_overlaps_plain_ones():
    sched = _scheduler()
    gate = sched.spec.gate
    gate.choose = lambda n: True  # as in the exploration's speculative steps
    sched.add_request(_request("a"))
    assert not sched.can_overlap()  # the next step speculates
    out = sched.schedule()  # a prefill: not a measurement
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[8]],
                                   draft_token_ids=[[9, 10, 11]]))
    sched.record_step(out, 1, 0.5)
    assert not gate.buckets
    assert not sched.can_overlap()
    assert out.propose_drafts  # the next step speculates: draft after this one
    gate.choose = lambda n: False  # from the step after the next one, the gate says plain
    out = sched.schedule()
    assert out.spec_token_ids == {"a": [9, 10, 11]}
    assert not out.propose_drafts  # the step after it is plain: nothing to draft for it
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[9, 10, 12]],
                                   draft_token_ids=[[13, 14]]))
    sched.record_step(out, 3, 0.25)
    rate = gate.buckets[1].spec
    assert (rate.num_steps, rate.tokens, rate.seconds) == (1, 3, 0.25)
    sched.record_step(out, 3, 0.25)  # recorded once only
    assert gate.buckets[1].spec.num_steps == 1

    assert sched.can_overlap()  # a plain step may overlap
    out = sched.schedule()
    assert not out.spec_token_ids and out.num_scheduled_tokens == {"a": 1}
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[13]],
                                   draft_token_ids=[[14]]))
    sched.record_step(out, 1, 0.1)
    assert gate.buckets[1].plain.num_steps == 1

    sched.add_request(_request("b"))  # a step with b's prefill in it is not measured
    out = sched.schedule()
    assert out.new_requests
    sched.update(out, RunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[14], [8]]))
    sched.record_step(out, 2, 1.0)
    assert set(gate.buckets) == {1} and gate.buckets[1].plain.num_steps == 1


def test_plain_steps_keep_the_running_acceptance_current():
    """While the gate runs plain steps, each request's first draft is scored against the token
    the step sampled, so a re-test starts from a current acceptance (depth), not a stale one."""
    sched = _scheduler()
    sched.spec.gate.choose = lambda n: False
    sched.add_request(_request("a"))
    out = sched.schedule()
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[8]],
                                   draft_token_ids=[[9, 10, 11]]))
    assert sched.spec.depth("a") == 3  # the prior: rate 0.5, draft_cost 0
    sched.spec.cfg = dataclasses.replace(sched.spec.cfg, draft_cost=0.3)
    for token in range(20, 30):  # every first draft is wrong
        out = sched.schedule()
        assert not out.spec_token_ids
        sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[token]],
                                       draft_token_ids=[[token + 100]]))
    assert sched.spec.depth("a") == 0
    assert sched.spec.stats()["spec_num_draft_tokens"] == 0  # not counted as verified
    for token in range(30, 50):  # now every first draft is right
        out = sched.schedule()
        sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[token]],
                                       draft_token_ids=[[token + 1]]))
    assert sched.spec.depth("a") >= 3


def test_a_speculative_step_without_drafts_is_the_modes_cost_not_a_verification():
    """Nothing to propose (a request's first tokens, a warm-up) still costs the speculative
    mode its synchronous step and the proposer's work: such a step feeds the mode's rate, not
    the plain one, but does not count as a measured verification."""
    sched = _scheduler()
    gate = sched.spec.gate
    gate.choose = lambda n: True
    sched.add_request(_request("a"))
    out = sched.schedule()  # the prefill
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[8]], draft_token_ids=[[]]))
    sched.record_step(out, 1, 0.5)
    out = sched.schedule()  # the speculative mode, no draft to verify
    assert not out.spec_token_ids and out.num_scheduled_tokens == {"a": 1}
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[9]],
                                   draft_token_ids=[[10, 11]]))
    sched.record_step(out, 1, 0.1)
    b = gate.buckets[1]
    assert (b.plain.num_steps, b.spec.num_steps, b.idle.num_steps) == (0, 0, 1)
    assert b.per_s(True) == pytest.approx(10.0) and b.plain.weight == 0
    out = sched.schedule()  # now with drafts: a speculative measurement
    assert out.spec_token_ids == {"a": [10, 11]}
    sched.update(out, RunnerOutput(req_ids=["a"], sampled_token_ids=[[10, 11, 12]],
                                   draft_token_ids=[[13]]))
    sched.record_step(out, 3, 0.2)
    assert (b.plain.num_steps, b.spec.num_steps, b.idle.num_steps) == (0, 1, 1)
    assert b.share < 1.0


def test_idle_speculative_steps_do_not_make_plain_decoding_look_slow():
    """A GPU: plain steps run as CUDA graphs, overlapped (1 unit); a speculative-mode step
    with nothing to verify is synchronous and runs the proposer (3 units); a verification
    costs 30 units for 7 tokens. Drafts exist in every third speculative step. The gate must
    settle on plain decoding after one verification, and re-test rarely."""
    gate = SpecGate(max_gain=9)
    n_spec = itertools.count()

    def cost(i, spec):
        if not spec:
            return 1, 1.0
        return (7, 30.0) if next(n_spec) % 3 == 2 else (1, 3.0)

    for i in range(3000):
        spec = gate.choose(1)
        tokens, seconds = cost(i, spec)
        gate.observe(1, spec, tokens, seconds, verified=tokens > 1)
    b = gate.buckets[1]
    assert b.measured and not b.best
    assert b.spec.num_steps <= 4 and b.idle.num_steps <= 8  # one verification ended it
    # a mode that never has anything to verify is judged after GATE_IDLE_STEPS steps
    gate = SpecGate(max_gain=9)
    modes = []
    for _ in range(GATE_MIN_STEPS + GATE_IDLE_STEPS + 1):
        spec = gate.choose(1)
        gate.observe(1, spec, 1, 1.2 if spec else 1.0, verified=False)
        modes.append(spec)
    assert modes == [False] * GATE_MIN_STEPS + [True] * GATE_IDLE_STEPS + [False]


def test_a_stretch_with_nothing_to_propose_does_not_flip_a_winning_mode():
    """A CPU on code editing: a verification emits 6 tokens for 2.2 plain steps' time, and a
    speculative-mode step with nothing to verify costs what a plain one does. Stretches of
    five such steps (an edited line) come every fifteen steps: speculation stays on."""
    gate = SpecGate(max_gain=9)
    n_spec = itertools.count()
    modes, best = [], []
    for _ in range(2000):
        spec = gate.choose(1)
        idle = spec and next(n_spec) % 15 < 5
        tokens, seconds = ((1, 1.0) if idle else (6, 2.2)) if spec else (1, 1.0)
        gate.observe(1, spec, tokens, seconds, verified=spec and not idle)
        modes.append(spec)
        best.append(gate.buckets[1].best)
    assert all(best[50:])  # never switched off; plain steps are only the rare re-tests
    assert len(modes) - sum(modes) < 0.02 * len(modes)


def test_the_static_bound_applies_to_the_next_step():
    """The next step's mode is decided at the end of `schedule`, while this step's tokens are
    still being sampled: they count as the decodes they will be, so a batch past
    `max_batch_tokens` neither drafts for the next step nor feeds a hidden-state proposer."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=256),
                      CacheConfig(block_size=4), 64,
                      SpecConfig(method="ngram", num_speculative_tokens=3, max_batch_tokens=2,
                                 draft_cost=0.0, gate=False))
    for rid in "abc":
        sched.add_request(_request(rid))
    out = sched.schedule()  # three prefills; three decodes next: past the bound
    assert not out.propose_drafts and not out.feed_proposer
    sched.abort_requests(["b", "c"])
    sched.update(out, RunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[8], [8], [8]]))
    out = sched.schedule()  # one decode now, one next: within the bound
    assert out.propose_drafts and out.feed_proposer


def test_a_bucket_next_to_a_hopeless_one_takes_its_verdict():
    """A batch shrinking through the buckets does not pay an exploration step in each of them
    when speculation was hopeless by far next door; the seeded estimate is re-tested later."""
    gate = SpecGate(max_gain=4)

    def cost(n):  # a speculative step costs 40 plain steps (eager against CUDA graphs)
        return lambda i, spec: (3 * n, 40.0 * n / 8) if spec else (n, 1.0 * n / 8)

    _run(gate, 50, cost(8), num_reqs=8)
    assert gate.buckets[8].measured and not gate.buckets[8].best
    modes = _run(gate, 3000, cost(4), num_reqs=4)
    assert modes[:GATE_MIN_STEPS + 1] == [False] * (GATE_MIN_STEPS + 1)  # no exploration step
    b4 = gate.buckets[4]
    assert b4.measured and not b4.best and b4.spec.num_steps == sum(modes) > 0  # re-tested
    assert b4.spec.per_s == pytest.approx(3 * 4 / (40.0 * 4 / 8))  # the real rate by now
    # merely slower next door (not twice max_gain) is explored as usual
    gate = SpecGate(max_gain=4)
    _run(gate, 50, lambda i, spec: (3, 6.0) if spec else (1, 1.0), num_reqs=8)
    assert gate.buckets[8].measured and not gate.buckets[8].best
    modes = _run(gate, GATE_MIN_STEPS + 1, lambda i, spec: (3, 6.0) if spec else (1, 1.0),
                 num_reqs=4)
    assert modes == [False] * GATE_MIN_STEPS + [True]
