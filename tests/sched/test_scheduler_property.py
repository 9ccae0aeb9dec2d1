"""Randomized workloads against the invariants: arrivals, lengths, aborts, cache sizes."""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeRunner, check_invariants, reference

from skyline.config import CacheConfig, SchedulerConfig
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, SamplingParams


def scenario(seed: int, async_scheduling: bool = False) -> None:
    """`async_scheduling`: schedule step n+1 before updating with step n, as the engine does
    on GPUs (the fake runner hands back the previous step's tokens at each launch)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([16, 32, 64])
    min_blocks = -(-max_model_len // block_size)
    num_blocks = rng.choice([min_blocks, min_blocks + 1, 2 * min_blocks, 8 * min_blocks])
    cfg = SchedulerConfig(
        max_num_seqs=rng.choice([1, 2, 4, 16]),
        max_num_batched_tokens=rng.choice([1, 3, 8, 32, 128]),
        max_model_len=max_model_len,
    )
    sched = Scheduler(
        cfg, CacheConfig(block_size, enable_prefix_caching=rng.random() < 0.8), num_blocks
    )
    runner = FakeRunner(block_size)
    prefixes = [
        [rng.randrange(97) for _ in range(rng.randrange(1, max_model_len // 2))] for _ in range(3)
    ]

    num_requests = rng.randrange(5, 30)
    pending: list[Request] = []
    for i in range(num_requests):
        n = rng.randrange(1, max_model_len)
        base = rng.choice(prefixes) if rng.random() < 0.6 else []
        p = (base + [rng.randrange(97) for _ in range(n)])[: max_model_len - 1]
        params = SamplingParams(
            max_tokens=rng.choice([None, 1, 3, 10, 40]),
            min_tokens=rng.choice([0, 0, 1]),
            stop_token_ids=rng.sample(range(97), rng.choice([0, 0, 2])),
            ignore_eos=rng.random() < 0.2,
        )
        eos = tuple(rng.sample(range(97), rng.choice([0, 1, 3])))
        pending.append(Request(f"r{i}", p, params, eos_token_ids=eos))

    outputs: dict[str, list[int]] = {r.request_id: [] for r in pending}
    final: dict[str, str] = {}
    aborted: set[str] = set()
    all_reqs = {r.request_id: r for r in pending}
    bound = 50 * num_requests * max_model_len
    step = 0
    in_flight = None

    def take(step_outputs):
        for o in step_outputs:
            assert o.request_id not in final and o.request_id not in aborted
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = o.finish_reason

    while pending or sched.has_unfinished() or in_flight is not None:
        assert step < bound, "no progress"
        step += 1
        # Arrivals and aborts happen between steps, as in the engine loop.
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim, "unknown"])
            aborted.add(victim)
            check_invariants(sched)
        if not sched.has_unfinished() and in_flight is None:
            continue
        num_preemptions = sched.num_preemptions
        so = sched.schedule()
        if sched.num_preemptions > num_preemptions:
            assert not so.new_requests, "no admission in a step short of memory"
        # Async: a step may be empty while every running request waits for its token.
        assert 0 < so.total_num_scheduled_tokens or (async_scheduling and in_flight)
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        check_invariants(sched)
        if async_scheduling:
            prev = runner.launch(so)
            if in_flight is not None:
                take(sched.update(in_flight, prev))
            in_flight = None if so.empty else so
        else:
            take(sched.update(so, runner.execute(so)))
        check_invariants(sched)

    assert set(final) | aborted == set(all_reqs) and not set(final) & aborted
    for rid, reason in final.items():
        r = all_reqs[rid]
        want, want_reason, _ = reference(
            r.prompt_token_ids, r.sampling_params, sched.max_len(r), r.eos_token_ids
        )
        assert outputs[rid] == want and reason == want_reason, rid
    pool = sched.kv_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(60))
def test_random_workload(seed):
    scenario(seed)


@pytest.mark.parametrize("seed", range(60))
def test_random_workload_async(seed):
    scenario(seed, async_scheduling=True)
