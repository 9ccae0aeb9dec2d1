"""KV headroom at admission (sched/headroom.py): the blocks each request is expected to add,
the learned share of max_tokens, and the scheduler admitting so that the cache does not
preempt."""

from __future__ import annotations

import pytest
from fake_runner import reference, run
from test_scheduler import assert_all_free, assert_reference, make, prompt, req

from skyline.sched.headroom import MEAN_WEIGHT, Headroom


def test_future_blocks_count_prompt_rest_and_share_of_budget():
    h = Headroom(block_size=4)
    r = req("a", prompt(1, 10), max_tokens=20)
    assert h.future_blocks(r, num_held=3, max_len=64) == 8 - 3  # 30 tokens in all
    assert h.future_blocks(r, num_held=3, max_len=16) == 4 - 3  # the budget ends at 16
    assert h.future_blocks(r, num_held=9, max_len=64) == 0  # holds more already
    h.ratio = 0.5
    assert h.future_blocks(r, num_held=3, max_len=64) == 5 - 3  # 10 + 10 tokens
    h.ratio = 0.01
    assert h.future_blocks(r, num_held=3, max_len=64) == 3 - 3  # 10 + 1 (rounded up)
    # no max_tokens: the rest of the prompt, and the mean output of such requests once known
    unbounded = req("b", prompt(2, 10), max_tokens=None)
    h = Headroom(4)
    assert h.future_blocks(unbounded, num_held=1, max_len=64) == 3 - 1
    for n in (4, 8):
        done = req(f"u{n}", prompt(3, 5), max_tokens=None)
        for _ in range(n):
            done.append_output_token(1)
        h.finished(done, max_len=64)
    assert h.unbounded_tokens == 6 and h.ratio == 1.0  # the bounded share is not touched
    assert h.future_blocks(unbounded, num_held=1, max_len=64) == 4 - 1  # 10 + 6 tokens
    assert h.future_blocks(unbounded, num_held=1, max_len=12) == 3 - 1  # capped at 12
    # the scale multiplies the share, capped at the whole budget
    assert Headroom(4, conservativeness=3.0).future_blocks(r, 3, 64) == 8 - 3
    assert Headroom(4, conservativeness=0.5).future_blocks(r, 3, 64) == 5 - 3


def test_ratio_learns_used_share_and_backs_off_on_preemption():
    h = Headroom(block_size=4)
    r = req("a", prompt(1, 10), max_tokens=20)
    for _ in range(5):
        r.append_output_token(1)
    h.finished(r, max_len=64)  # used a quarter of its budget: the mean with the starting 1
    assert h.ratio == pytest.approx(0.625)
    h.finished(r, max_len=64)
    assert h.ratio == pytest.approx(0.5)
    for _ in range(40):  # then each finish moves it by MEAN_WEIGHT of the difference at least
        h.finished(r, max_len=64)
    assert h.num_finished == 42
    last = h.ratio
    h.finished(r, max_len=64)
    assert last - h.ratio == pytest.approx(MEAN_WEIGHT * (last - 0.25))
    for _ in range(500):
        h.finished(r, max_len=64)
    assert h.ratio == pytest.approx(0.25, abs=1e-3)
    h.preempted()
    assert h.ratio == pytest.approx(0.625, abs=1e-3)
    before = h.ratio
    h.finished(req("b", prompt(2, 4), max_tokens=None), max_len=64)  # no budget: not a share
    assert h.ratio == before


def _workload(n: int, eos: tuple[int, ...] = ()):
    return [req(f"r{i}", prompt(i, 6 + (5 * i) % 13), max_tokens=12 + i % 7, eos=eos)
            for i in range(n)]


@pytest.mark.parametrize("caching", [True, False])
def test_admission_headroom_avoids_preemption_with_the_same_tokens(caching):
    # a cache of 16 blocks of 4 holds two or three of these requests at their full length:
    # admitting on current need alone preempts, the headroom does not, and both give every
    # request its reference tokens
    def go(conservativeness: float):
        sched, runner = make(num_blocks=16, block_size=4, max_model_len=40, budget=32,
                             caching=caching, conservativeness=conservativeness)
        reqs = _workload(24)
        for r in reqs:
            sched.add_request(r)
        outputs, final, steps = run(sched, runner, max_steps=5_000)
        assert_reference(sched, reqs, outputs, final)
        assert_all_free(sched)
        return sched.num_preemptions, outputs

    preempted, want = go(0.0)
    assert preempted > 0
    none, got = go(1.0)
    assert none == 0
    assert got == want


def test_early_stops_lower_the_ratio_and_admit_more():
    # requests that end at an EOS long before max_tokens teach a low ratio, so later requests
    # run side by side again
    sched, runner = make(num_blocks=64, block_size=4, max_model_len=128, budget=64,
                         max_num_seqs=16)
    eos = tuple(range(0, 97, 3))  # about one token in three ends a request
    reqs = [req(f"r{i}", prompt(i, 8), max_tokens=100, eos=eos) for i in range(40)]
    for r in reqs:
        sched.add_request(r)
    peaks = []
    outputs, final, _ = run(sched, runner, on_step=lambda s, so: peaks.append(sched.num_running))
    assert_reference(sched, reqs, outputs, final)
    used = [len(reference(r.prompt_token_ids, r.sampling_params, 128, eos)[0]) for r in reqs]
    assert max(used) < 50  # the workload does stop early
    assert sched.headroom.ratio < 0.5
    # at first each request reserves its whole budget (27 blocks: two at a time), later a
    # fraction of it
    assert peaks[0] <= 2 and max(peaks) >= 10
    assert sched.stats()["headroom_ratio"] == sched.headroom.ratio
    assert_all_free(sched)


def test_start_all_only_for_a_queue_that_fits_and_a_small_excess():
    h = Headroom(block_size=4)
    blocks = {"a": [0, 1], "b": [2, 3]}  # two running requests of 8 tokens, 8 more to come
    running = [req(k, prompt(i, 8), max_tokens=8) for i, k in enumerate(blocks)]
    held = lambda rid: blocks[rid]  # noqa: E731
    cap = lambda r: 64  # noqa: E731
    waiting = [req("c", prompt(3, 8), max_tokens=8)]
    res = h.reserved(running, held, cap)
    assert res == 4
    # expected at most: 2 x 4 + 4 = 12 blocks; within 1/8 over a cache of 11, not of 10
    assert h.start_all(running, waiting, held, cap, num_free=7, reserve=res)
    assert not h.start_all(running, waiting, held, cap, num_free=6, reserve=res)
    # the queue must fit the free blocks now (its 2 blocks of prompt), whatever the excess
    assert not h.start_all(running, waiting, held, cap, num_free=1, reserve=res)
    off = Headroom(4, overcommit=None)
    assert not off.start_all(running, waiting, held, cap, num_free=7, reserve=res)
    # a learned share below 1 expects less: 2 x 3 + 3 blocks fit a cache of 8
    h.ratio = 0.5
    assert h.start_all(running, waiting, held, cap, num_free=4,
                       reserve=h.reserved(running, held, cap))


def test_the_last_of_the_queue_starts_with_the_rest_not_after_it():
    # 17 requests of 8 + 8 tokens, a cache of 32 blocks of 4 (eight at their full length):
    # holding back all that may not fit runs waves of 8, 8 and then one request alone; the
    # last one starts beside the second wave (one request's excess: 1/8 of the cache) and
    # every request still gets its reference tokens (the excess is one preemption near the
    # end, whose recompute and last tokens take a few steps instead of eight)
    def go(start_all: bool):
        sched, runner = make(num_blocks=32, block_size=4, max_model_len=40, budget=64)
        if not start_all:
            sched.headroom.overcommit = None
        reqs = [req(f"r{i}", prompt(i, 8), max_tokens=8) for i in range(17)]
        for r in reqs:
            sched.add_request(r)
        outputs, final, steps = run(sched, runner)
        assert_reference(sched, reqs, outputs, final)
        assert_all_free(sched)
        return steps, outputs

    planned, want = go(start_all=False)
    together, got = go(start_all=True)
    assert got == want
    assert together <= planned - 4
