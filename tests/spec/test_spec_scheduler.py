"""The scheduler's speculative slots against a model-free runner that checks every KV read:
drafts reserve slots, rejected ones are given back exactly (their KV is rewritten before anyone
reads it), tail blocks are freed, stop tokens and max_tokens cut accepted drafts, preemption
and aborts still work, and no block leaks. Outputs equal the no-speculation reference."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "sched"))
from fake_runner import check_invariants, next_token, reference  # noqa: E402

from skyline.config import CacheConfig, SchedulerConfig, SpecConfig  # noqa: E402
from skyline.sched.scheduler import Scheduler  # noqa: E402
from skyline.types import Request, RunnerOutput, SamplingParams, SchedulerOutput  # noqa: E402


class SpecFakeRunner:
    """Like tests/sched/fake_runner.py, plus drafts: right with some probability, verified
    greedily against `next_token`."""

    def __init__(self, block_size: int, rng: random.Random, depth: int) -> None:
        self.block_size = block_size
        self.rng = rng
        self.depth = depth
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.reqs: dict[str, dict] = {}
        self.num_freed = 0

    def _slot(self, st: dict, pos: int) -> tuple[int, int]:
        return st["blocks"][pos // self.block_size], pos % self.block_size

    def _propose(self, tokens: list[int]) -> list[int]:
        out, seq, p = [], list(tokens), self.rng.random()
        for _ in range(self.rng.randrange(self.depth + 1)):
            t = next_token(seq) if self.rng.random() < p else self.rng.randrange(97)
            out.append(t)
            seq.append(t)
        return out

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_request_ids:
            self.reqs.pop(rid, None)
        for nr in so.new_requests:
            self.reqs[nr.request_id] = dict(
                tokens=list(nr.prompt_token_ids) + list(nr.output_token_ids),
                blocks=list(nr.block_ids), computed=nr.num_computed_tokens)
        for cr in so.cached_requests:
            st = self.reqs[cr.request_id]
            assert st["computed"] == cr.num_computed_tokens
            if cr.num_freed_blocks:
                self.num_freed += cr.num_freed_blocks
                del st["blocks"][-cr.num_freed_blocks :]
            st["blocks"] += cr.new_block_ids
        spans = {}
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            drafts = so.spec_token_ids.get(rid, [])
            seq = st["tokens"] + drafts
            start, end = st["computed"], st["computed"] + n
            assert end <= len(seq) and (not drafts or end == len(seq))
            assert len(st["blocks"]) * self.block_size >= end, "no slot for a draft"
            for pos in range(start):
                assert self.slots.get(self._slot(st, pos)) == (pos, hash(tuple(seq[: pos + 1]))), (
                    f"{rid}: stale KV at {pos} (a rejected draft's slot was not given back?)")
            spans[rid] = (seq, start, end, drafts)
        out = RunnerOutput()
        for rid, (seq, start, end, drafts) in spans.items():
            st = self.reqs[rid]
            for pos in range(start, end):
                self.slots[self._slot(st, pos)] = (pos, hash(tuple(seq[: pos + 1])))
            out.req_ids.append(rid)
            out.logprobs.append(None)
            if end < len(seq):
                st["computed"] = end
                out.sampled_token_ids.append([])
                out.draft_token_ids.append([])
                continue
            emitted: list[int] = []
            for j in range(len(drafts) + 1):
                t = next_token(st["tokens"] + emitted)
                emitted.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
            st["tokens"] += emitted
            st["computed"] = end - (len(drafts) + 1 - len(emitted))
            out.sampled_token_ids.append(emitted)
            out.draft_token_ids.append(self._propose(st["tokens"]))
        return out


def scenario(seed: int) -> tuple[int, int, int]:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([16, 32, 64])
    min_blocks = -(-max_model_len // block_size)
    num_blocks = rng.choice([min_blocks, min_blocks + 2, 2 * min_blocks, 8 * min_blocks])
    cfg = SchedulerConfig(max_num_seqs=rng.choice([1, 2, 4, 16]),
                          max_num_batched_tokens=rng.choice([1, 3, 8, 32, 128]),
                          max_model_len=max_model_len)
    depth = rng.choice([1, 3, 6])
    spec = SpecConfig(method="ngram", num_speculative_tokens=depth, max_batch_tokens=64,
                      gate=False)  # no clock here: every decode step within the bound drafts
    sched = Scheduler(cfg, CacheConfig(block_size, enable_prefix_caching=rng.random() < 0.8),
                      num_blocks, spec)
    runner = SpecFakeRunner(block_size, rng, depth)
    pending = []
    for i in range(rng.randrange(3, 20)):
        p = [rng.randrange(97) for _ in range(rng.randrange(1, max_model_len // 2))]
        params = SamplingParams(max_tokens=rng.choice([None, 1, 2, 5, 20]),
                                min_tokens=rng.choice([0, 0, 1]),
                                stop_token_ids=rng.sample(range(97), rng.choice([0, 0, 3])),
                                ignore_eos=rng.random() < 0.3)
        eos = tuple(rng.sample(range(97), rng.choice([0, 1, 2])))
        pending.append(Request(f"r{i}", p, params, eos_token_ids=eos))
    want = {r.request_id: reference(list(r.prompt_token_ids), r.sampling_params, max_model_len,
                                    r.eos_token_ids) for r in pending}
    outputs: dict[str, list[int]] = {r.request_id: [] for r in pending}
    final: dict[str, tuple] = {}
    aborted: set[str] = set()
    step = 0
    while pending or sched.has_unfinished():
        step += 1
        assert step < 20_000, "no progress"
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        if not sched.has_unfinished():
            continue
        so = sched.schedule()
        assert 0 < so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        for rid, d in so.spec_token_ids.items():
            assert so.num_scheduled_tokens[rid] == 1 + len(d) and 0 < len(d) <= depth
        check_invariants(sched)
        for o in sched.update(so, runner.execute(so)):
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.stop_reason)
        check_invariants(sched)
    pool = sched.kv_manager.block_pool
    assert pool.num_free_blocks == num_blocks and sched.kv_manager.num_held_blocks() == 0
    assert not sched._drafts and not sched._num_freed_blocks
    for rid, (toks, reason, stop) in want.items():
        if rid in aborted:
            continue
        assert outputs[rid] == toks, rid
        assert final[rid] == (reason, stop), rid
    return sched.spec.num_accepted_tokens, runner.num_freed, sched.num_preemptions


@pytest.mark.parametrize("seed", range(60))
def test_spec_scheduler_randomized(seed):
    scenario(seed)


def test_spec_scenarios_exercise_acceptance_trimming_and_preemption():
    accepted = freed = preempted = 0
    for seed in range(60):
        a, f, p = scenario(seed)
        accepted, freed, preempted = accepted + a, freed + f, preempted + p
    assert accepted > 100 and freed > 10 and preempted > 10
