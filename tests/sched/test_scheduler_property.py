"""Randomized workloads against the invariants: arrivals, lengths, aborts, cache sizes."""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeRunner, FakeTiers, check_invariants, reference

from skyline.cache.offload import TierConnector, TierLayout
from skyline.config import CacheConfig, SchedulerConfig
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, SamplingParams


def scenario(seed: int, async_scheduling: bool = False, tiers: bool = False) -> None:
    """`async_scheduling`: schedule step n+1 before updating with step n, as the engine does
    on GPUs (the fake runner hands back the previous step's tokens at each launch). `tiers`:
    KV tiers of random sizes and policy below the device, whose transfers end after random
    delays and whose disk reads and writes sometimes fail."""
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
    connector = None
    if tiers:
        disk = rng.choice([-1, 0, num_blocks, 4 * num_blocks])
        layout = TierLayout(rng.choice([1, 4, num_blocks, 3 * num_blocks]), disk,
                            rng.random() < 0.9, ram_is_buffer=rng.random() < 0.3)
        connector = TierConnector(layout, block_size, eager=rng.random() < 0.3,
                                  ram_headroom=rng.choice([1, 4, 4 * num_blocks]))
    sched = Scheduler(
        cfg, CacheConfig(block_size, enable_prefix_caching=tiers or rng.random() < 0.8),
        num_blocks, connector=connector,
    )
    runner = FakeRunner(block_size)
    if tiers:
        runner.tiers = FakeTiers(runner, rng, delay=rng.choice([0, 1, 3]),
                                 fail=rng.choice([0.0, 0.2, 0.5]))
    prefixes = [
        [rng.randrange(97) for _ in range(rng.randrange(1, max_model_len // 2))] for _ in range(3)
    ]

    num_requests = rng.randrange(5, 30)
    pending: list[Request] = []
    for i in range(num_requests):
        n = rng.randrange(1, max_model_len)
        base = rng.choice(prefixes) if rng.random() < 0.6 else []
        p = (base + [rng.randrange(97) for _ in range(n)])[: max_model_len - 1]
        if tiers and pending and rng.random() < 0.3:  # a prompt seen before, evicted since?
            p = list(rng.choice(pending).prompt_token_ids)
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
        running = {r.request_id for r in sched.running}
        so = sched.schedule()
        if sched.num_preemptions > num_preemptions:  # (loaded requests are sent whole)
            assert {r.request_id for r in so.new_requests} <= running, (
                "no admission in a step short of memory")
        # Async: a step may be empty while every running request waits for its token; a step
        # may only wait for KV transfers, or only start them (or find none to start).
        assert (0 < so.total_num_scheduled_tokens or (async_scheduling and in_flight)
                or so.kv_in_flight or not sched.requests)
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert len(sched.running) + len(sched.kv_loads.loading) <= cfg.max_num_seqs
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
    if connector is not None:
        assert not connector.num_in_flight
        connector.check_invariants()
        return connector.counts
    return None


@pytest.mark.parametrize("seed", range(60))
def test_random_workload(seed):
    scenario(seed)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_workload_with_tiers(async_scheduling):
    """Loads, stores, spills and drops with delays and failures: every token as if computed,
    no block leaked, and the tiers were used (hits in RAM and on disk, failed writes; failed
    reads are rarer here: tests/cache/test_offload.py has them)."""
    totals: dict[str, int] = {}
    for seed in range(80):
        for k, v in scenario(seed, async_scheduling, tiers=True).items():
            totals[k] = totals.get(k, 0) + v
    assert totals["ram_hit_tokens"] and totals["disk_hit_tokens"], totals
    assert totals["store_failed_blocks"], totals
    assert totals["ram_evicted_blocks"] and totals["disk_evicted_blocks"], totals


@pytest.mark.parametrize("seed", range(60))
def test_random_workload_async(seed):
    scenario(seed, async_scheduling=True)
