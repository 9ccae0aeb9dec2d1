"""Speculative decoding end to end on tiny random HF models: greedy output is identical with
and without speculation (batching, chunked prefill, preemption, stop tokens, max_tokens), seeded
sampling is unchanged, no block leaks, and acceptance metrics are sane."""

from __future__ import annotations

import dataclasses
import random

import pytest

from skyline import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 320


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    # Weights large enough that greedy decoding wanders: many drafts are rejected.
    return tiny_llama(0.15)


@pytest.fixture(scope="module")
def loopy_model(tiny_llama):
    # Small weights: greedy decoding soon repeats itself, so most drafts are accepted.
    return tiny_llama(0.02)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves, so that prompt lookup finds something to propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(2, VOCAB - 1) for _ in range(rng.randint(3, 8))]
        out.append(motif * rng.randint(2, 5) + [rng.randrange(2, VOCAB - 1)])
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


def _run(path: str, prompts, params=GREEDY, **kw) -> tuple[list[list[int]], dict]:
    llm = LLM(path, device="cpu", dtype="float32", **kw)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    kv = llm.engine.scheduler.kv_manager
    assert kv.block_pool.num_free_blocks == llm.engine.executor.num_blocks, "blocks leaked"
    assert kv.num_held_blocks() == 0
    kv.block_pool.check_invariants()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_identical_with_speculation(tiny_model, method):
    prompts = _prompts(12, seed=1)
    ref, _ = _run(tiny_model, prompts)
    spec = dict(SPEC, speculative_method=method)
    ours, stats = _run(tiny_model, prompts, **spec)
    assert ours == ref
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    # one request alone, and a tiny budget: prefill chunks of 5 mixed with verifications
    assert _run(tiny_model, prompts[:1], **spec)[0] == ref[:1]
    assert _run(tiny_model, prompts, max_num_batched_tokens=5, **spec)[0] == ref
    # a tiny cache forces preemption by recompute while drafts hold slots
    ours, stats = _run(tiny_model, prompts, num_blocks=24, block_size=4, max_model_len=96,
                        schedule_conservativeness=0,
                       **spec)
    assert ours == ref and stats["num_preemptions"] > 0


def test_stop_token_and_max_tokens(tiny_model):
    prompts = _prompts(6, seed=2)
    free, _ = _run(tiny_model, prompts)
    for prompt, toks in zip(prompts, free, strict=True):
        stop = toks[7]
        first = toks.index(stop)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                stop_token_ids=[stop])
        ours, _ = _run(tiny_model, [prompt], params, **SPEC)
        assert ours[0] == toks[: first + 1]
        for n in (1, 2, 5, 11):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            assert _run(tiny_model, [prompt], params, **SPEC)[0][0] == toks[:n]


def test_seeded_sampling_unchanged_by_speculation(tiny_model):
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.1, max_tokens=20,
                            seed=7, ignore_eos=True)
    ref, _ = _run(tiny_model, prompts, params)
    ours, stats = _run(tiny_model, prompts, params, **SPEC)
    assert ours == ref
    assert stats["spec_num_draft_tokens"] > 0


def test_acceptance_metrics_on_repetitive_prompt(loopy_model):
    prompts = _prompts(4, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ref, _ = _run(loopy_model, prompts, params)
    # every step speculates (the measured gate may find plain steps faster on this machine)
    ours, stats = _run(loopy_model, prompts, params, speculative_gate=False, **SPEC)
    assert ours == ref
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    verified = stats["spec_num_verifications"]
    assert 0 < accepted <= drafted and verified > 0
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert stats["spec_acceptance_rate"] > 0.4
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + accepted / verified)
    assert stats["spec_mean_accepted_length"] > 1.8
    by_pos = [stats[f"spec_acceptance_pos_{j}"] for j in range(4)]
    assert all(0.0 < a <= 1.0 for a in by_pos)
    # every emitted token came from a verification or a plain step
    assert verified + accepted <= sum(len(t) for t in ours)


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_gate_flipping_modes_changes_no_output(loopy_model, async_mode):
    """The speculation gate switching mode at random steps (with async scheduling, plain steps
    overlap and speculative ones do not) changes nothing a client sees: greedy tokens, stops,
    max_tokens, seeded sampling with penalties; no block leaks."""
    prompts = _prompts(10, seed=5)
    ref, _ = _run(loopy_model, prompts)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=13, stop_token_ids=[ref[1][6]]),
        SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, max_tokens=17,
                       seed=3, ignore_eos=True),
    ]
    reqs = [(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    expected = [o.outputs[0].token_ids for o in LLM(loopy_model, device="cpu", dtype="float32")
                .generate([p for p, _ in reqs], [sp for _, sp in reqs])]

    llm = LLM(loopy_model, device="cpu", dtype="float32", async_scheduling=async_mode, **SPEC)
    sched = llm.engine.scheduler
    rng = random.Random(1)
    sched.spec.gate.choose = lambda n: rng.random() < 0.5
    sched.spec.cfg = dataclasses.replace(sched.spec.cfg, draft_cost=0.0)  # every draft
    overlapped = []
    can_overlap = sched.can_overlap
    sched.can_overlap = lambda: overlapped.append(can_overlap()) or overlapped[-1]
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert 0.25 < stats["spec_gate_speculated_fraction"] < 0.75
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    if async_mode == "on":
        assert 0 < sum(overlapped) < len(overlapped)
    kv = sched.kv_manager
    assert kv.block_pool.num_free_blocks == llm.engine.executor.num_blocks
    kv.block_pool.check_invariants()


def test_plain_stretches_draft_nothing(loopy_model):
    """While the gate runs plain steps, the proposer is asked for depth 0 (it keeps its state
    and drafts nothing); a speculative stretch after it gets full-depth drafts again."""
    prompts = _prompts(4, seed=9)
    llm = LLM(loopy_model, device="cpu", dtype="float32", **SPEC)
    sched, runner = llm.engine.scheduler, llm.engine.executor.runner
    sched.spec.cfg = dataclasses.replace(sched.spec.cfg, draft_cost=0.0)
    depths = []
    propose = runner.proposer.propose
    runner.proposer.propose = lambda r, t, d: depths.append(d) or propose(r, t, d)
    sched.spec.gate.choose = lambda n: False
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert depths and set(depths) == {0}
    assert llm.engine.stats()["spec_num_draft_tokens"] == 0
    sched.spec.gate.choose = lambda n: True
    depths.clear()
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert spec == plain and SPEC["num_speculative_tokens"] in depths
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
