from __future__ import annotations

import pytest
from fake_runner import FakeRunner, check_invariants, reference, run

from skyline.config import CacheConfig, SchedulerConfig
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, RequestStatus, RunnerOutput, SamplingParams


def make(
    num_blocks: int = 256,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 128,
    caching: bool = True,
    conservativeness: float = 1.0,
) -> tuple[Scheduler, FakeRunner]:
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
            schedule_conservativeness=conservativeness,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
    )
    return sched, FakeRunner(block_size)


def req(rid: str, prompt: list[int], max_tokens: int | None = 8, **kw) -> Request:
    eos = kw.pop("eos", ())
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=eos)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 13 + i * 7) % 97 for i in range(n)]


def assert_reference(sched: Scheduler, reqs: list[Request], outputs, final) -> None:
    for r in reqs:
        want, reason, stop = reference(
            r.prompt_token_ids, r.sampling_params, sched.max_len(r), r.eos_token_ids
        )
        assert outputs[r.request_id] == want, r.request_id
        assert final[r.request_id].finish_reason == reason
        assert final[r.request_id].stop_reason == stop


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.kv_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.kv_manager._blocks and not sched.kv_manager._hashes and not sched.running
    pool.check_invariants()


def test_single_request_matches_reference():
    sched, runner = make()
    r = req("a", prompt(1, 10), max_tokens=12)
    sched.add_request(r)
    outputs, final, steps = run(sched, runner)
    assert_reference(sched, [r], outputs, final)
    assert steps == 12  # one prefill step, then one decode per step
    assert final["a"].num_prompt_tokens == 10 and final["a"].num_cached_tokens == 0
    assert_all_free(sched)


def test_chunked_prefill_with_decodes_riding_along():
    sched, runner = make(budget=16)
    sched.add_request(req("short", prompt(1, 5), max_tokens=20))
    seen = []

    def on_step(step, so):
        seen.append(dict(so.num_scheduled_tokens))
        if step == 1:
            sched.add_request(req("long", prompt(2, 50), max_tokens=4))

    run(sched, runner, on_step=on_step)
    # Step 0: short prefills. Step 1: short decodes. From step 2 on, long's prompt goes in
    # chunks of budget - 1 while short keeps decoding in the same step.
    assert seen[0] == {"short": 5} and seen[1] == {"short": 1}
    assert seen[2] == {"short": 1, "long": 15}
    assert seen[3] == {"short": 1, "long": 15}
    assert seen[4] == {"short": 1, "long": 15}
    assert seen[5] == {"short": 1, "long": 5}
    assert all(sum(s.values()) <= 16 for s in seen)


def test_budget_and_max_num_seqs():
    sched, runner = make(budget=20, max_num_seqs=3)
    reqs = [req(f"r{i}", prompt(i, 3 + i % 9), max_tokens=5 + i % 4) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    peak = 0

    def on_step(step, so):
        nonlocal peak
        peak = max(peak, sched.num_running)
        assert len(so.num_scheduled_tokens) <= 3

    outputs, final, _ = run(sched, runner, on_step=on_step)
    assert peak == 3
    assert_reference(sched, reqs, outputs, final)
    assert_all_free(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_tiny_cache_same_tokens_as_huge_cache(caching):
    def workload():
        return [req(f"r{i}", prompt(i, 5 + (3 * i) % 11), max_tokens=8 + i % 5) for i in range(10)]

    big, big_runner = make(num_blocks=1024, max_model_len=32, caching=caching)
    for r in workload():
        big.add_request(r)
    want, want_final, _ = run(big, big_runner)
    assert big.num_preemptions == 0

    # no headroom at admission, so that the tiny cache preempts
    tiny, tiny_runner = make(num_blocks=8, block_size=4, max_model_len=32, caching=caching,
                             conservativeness=0)
    reqs = workload()
    for r in reqs:
        tiny.add_request(r)
    got, got_final, steps = run(tiny, tiny_runner, max_steps=2_000)
    assert tiny.num_preemptions > 0
    assert tiny.stats()["num_preemptions"] == tiny.num_preemptions
    assert got == want
    assert {k: v.finish_reason for k, v in got_final.items()} == {
        k: v.finish_reason for k, v in want_final.items()
    }
    assert_reference(tiny, reqs, got, got_final)
    assert_all_free(tiny)


def test_preempted_request_is_forgotten_then_sent_whole_again():
    sched, runner = make(num_blocks=8, block_size=4, max_model_len=32, budget=64,
                         conservativeness=0)
    sched.add_request(req("a", prompt(1, 12), max_tokens=19))
    sched.add_request(req("b", prompt(2, 12), max_tokens=19))
    forgotten: set[str] = set()
    resumed = []

    def on_step(step, so):
        # The runner must forget a preempted request (in this step's finished ids) before it
        # is sent whole again, with its outputs so far; FakeRunner asserts the former too.
        for rid in so.finished_request_ids:
            forgotten.add(rid)
        for nr in so.new_requests:
            if nr.output_token_ids:
                assert nr.request_id in forgotten
                resumed.append(nr.request_id)

    outputs, final, _ = run(sched, runner, on_step=on_step)
    assert sched.num_preemptions >= 1 and resumed
    assert sum(r == "b" for r in resumed) == sched.num_preemptions  # the newest is the victim
    assert len(outputs["a"]) == len(outputs["b"]) == 19
    assert_all_free(sched)


def test_stop_conditions():
    sched, runner = make(max_model_len=20)
    p = prompt(3, 6)
    ref, _, _ = reference(p, SamplingParams(max_tokens=30), 1000)
    eos = ref[2]
    stop_id = ref[4]
    reqs = [
        req("eos", p, max_tokens=10, eos=(eos,)),
        req("ignore", p, max_tokens=10, eos=(eos,), ignore_eos=True),
        req("stopid", p, max_tokens=10, stop_token_ids=[stop_id]),
        req("min", p, max_tokens=10, eos=(eos,), min_tokens=4),
        req("len", p, max_tokens=5),
        req("ctx", p, max_tokens=None),
    ]
    for r in reqs:
        sched.add_request(r)
    outputs, final, _ = run(sched, runner)
    assert outputs["eos"] == ref[:3] and final["eos"].finish_reason == "stop"
    assert final["eos"].stop_reason is None
    assert len(outputs["ignore"]) == 10 and final["ignore"].finish_reason == "length"
    assert outputs["stopid"] == ref[: ref.index(stop_id) + 1]
    assert final["stopid"].stop_reason == stop_id
    assert len(outputs["min"]) >= 4 and final["len"].finish_reason == "length"
    assert len(outputs["ctx"]) == 20 - 6 and final["ctx"].finish_reason == "length"
    assert_reference(sched, reqs, outputs, final)
    assert sched.stats()["num_running"] == 0


def test_stop_token_at_max_tokens_is_stop():
    sched, runner = make()
    p = prompt(4, 5)
    ref, _, _ = reference(p, SamplingParams(max_tokens=30), 1000)
    sched.add_request(req("a", p, max_tokens=3, stop_token_ids=[ref[2]]))
    _, final, _ = run(sched, runner)
    assert final["a"].finish_reason == "stop" and final["a"].stop_reason == ref[2]


def test_abort_waiting_and_running_frees_blocks():
    sched, runner = make(num_blocks=16, max_num_seqs=1, max_model_len=64)
    sched.add_request(req("run", prompt(1, 10), max_tokens=50))
    sched.add_request(req("wait", prompt(2, 10)))
    so = sched.schedule()
    sched.update(so, runner.execute(so))
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.kv_manager.num_free_blocks < 16
    sched.abort_requests(["wait", "nope"])
    assert sched.num_waiting == 0 and sched.has_unfinished()
    sched.abort_requests(["run"])
    assert not sched.has_unfinished() and sched.kv_manager.num_free_blocks == 16
    assert_all_free(sched)
    so = sched.schedule()
    assert so.empty and so.finished_request_ids == {"run", "wait"}
    sched.abort_requests(["run"])  # finished ids are ignored


def test_abort_between_schedule_and_update_produces_no_output():
    sched, runner = make()
    sched.add_request(req("a", prompt(1, 6)))
    sched.add_request(req("b", prompt(2, 6)))
    so = sched.schedule()
    ro = runner.execute(so)
    sched.abort_requests(["a"])
    outs = sched.update(so, ro)
    assert [o.request_id for o in outs] == ["b"]
    check_invariants(sched)


def test_prefix_hit_reduces_scheduled_tokens():
    sched, runner = make(budget=256)
    system = prompt(9, 40)  # 10 full blocks
    a = req("a", system + [1, 2, 3], max_tokens=2)
    sched.add_request(a)
    run(sched, runner)
    b = req("b", system + [4, 5], max_tokens=2)
    sched.add_request(b)
    scheduled = []
    outputs, final, _ = run(sched, runner, on_step=lambda s, so: scheduled.append(so))
    assert scheduled[0].num_scheduled_tokens["b"] == 42 - 40
    assert scheduled[0].new_requests[0].num_computed_tokens == 40
    assert final["b"].num_cached_tokens == 40
    assert_reference(sched, [b], outputs, final)
    st = sched.stats()
    assert st["prefix_cache_hit_tokens"] == 40
    assert st["prefix_cache_query_tokens"] == 43 + 42


def test_identical_prompts_in_one_step_share_after_compute():
    # Two identical prompts admitted together cannot hit each other (nothing computed yet);
    # a third one later does.
    sched, runner = make(budget=256)
    p = prompt(5, 17)
    reqs = [req(r, p) for r in ("x", "y")]
    for r in reqs:
        sched.add_request(r)
    outputs, final, _ = run(sched, runner)
    assert outputs["x"] == outputs["y"]
    z = req("z", p)
    sched.add_request(z)
    outputs, final, _ = run(sched, runner)
    assert final["z"].num_cached_tokens == 16
    assert_all_free(sched)


def test_mid_prefill_produces_no_output_and_runner_output_order_free():
    sched, runner = make(budget=8)
    sched.add_request(req("a", prompt(1, 20), max_tokens=1))
    so = sched.schedule()
    ro = runner.execute(so)
    assert ro.sampled_token_ids == [[]]
    assert sched.update(so, ro) == []
    so = sched.schedule()
    assert so.cached_requests[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"a": 8}
    assert sched.update(so, RunnerOutput(["a"], [[]], [None])) == []


def test_rejects_prompt_without_room():
    sched, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(req("a", list(range(16))))
    with pytest.raises(ValueError):
        sched.add_request(req("b", []))
    sched.add_request(req("c", [1]))
    with pytest.raises(ValueError, match="in use"):
        sched.add_request(req("c", [1]))
    assert sched.requests["c"].status is RequestStatus.WAITING


def test_cache_too_small_for_max_model_len_is_refused():
    with pytest.raises(AssertionError):
        make(num_blocks=3, block_size=4, max_model_len=16)
