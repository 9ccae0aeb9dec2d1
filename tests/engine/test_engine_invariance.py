"""Greedy tokens must not change with batching, chunking, prefix reuse or preemption, and must
equal Hugging Face transformers' greedy continuation (fp32, tiny random models)."""

from __future__ import annotations

import random

import pytest
import torch

from skyline import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 320


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_model(request, tmp_path_factory):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=VOCAB - 1, bos_token_id=1)
    if request.param == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    # Larger weights than the default init, so greedy decoding is not one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(request.param)
    model.eval().save_pretrained(path, safe_serialization=True)
    return str(path), model


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(path: str, prompts, params=GREEDY, **kw) -> list[list[int]]:
    llm = LLM(path, device="cpu", dtype="float32", **kw)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    # every block back in the pool once all requests are done
    pool = llm.engine.scheduler.kv_manager.block_pool
    assert pool.num_free_blocks == llm.engine.executor.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_hf_generate(tiny_model):
    path, hf = tiny_model
    prompts = _prompts(3, seed=1)
    ours = _run(path, prompts)
    for p, toks in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
        assert toks == ref[0, len(p):].tolist()


def check_invariance(path: str, num_prompts: int, num_alone: int, prefix_len: int,
                     num_prefixed: int) -> None:
    """Greedy tokens of `num_prompts` prompts: the same alone (the first `num_alone`), batched,
    in prefill chunks of 5 tokens, under preemption by recompute (and with the headroom at
    admission that avoids it), and with a shared prefix of
    `prefix_len` tokens reused from the prefix cache (the first `num_prefixed`)."""
    prompts = _prompts(num_prompts, seed=2)
    alone = [_run(path, [p])[0] for p in prompts[:num_alone]]
    batched = _run(path, prompts)
    assert batched[:num_alone] == alone
    # tiny token budget: every prompt is prefilled in chunks of 5, mixed with decodes
    assert _run(path, prompts, max_num_batched_tokens=5) == batched
    # a tiny cache forces preemption by recompute
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=16, block_size=4,
              max_model_len=64, schedule_conservativeness=0)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == batched
    assert llm.engine.stats()["num_preemptions"] > 0
    # the same cache with KV headroom at admission (the default): no preemption
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=16, block_size=4,
              max_model_len=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == batched
    assert llm.engine.stats()["num_preemptions"] == 0
    # prefix reuse: a shared prefix, run twice in one engine
    shared = _prompts(1, seed=3, lo=prefix_len, hi=prefix_len)[0]
    pref = [shared + p for p in prompts[:num_prefixed]]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4)
    first = [o.outputs[0].token_ids for o in llm.generate(pref, GREEDY)]
    again = llm.generate(pref, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == first
    assert all(o.num_cached_tokens >= prefix_len for o in again)
    assert first == _run(path, pref, enable_prefix_caching=False)


def test_batch_chunk_prefix_preempt_invariance(tiny_model):
    check_invariance(tiny_model[0], 16, 4, 32, 6)


def test_seeded_sampling_ignores_batch(tiny_model):
    path, _ = tiny_model
    prompts = _prompts(6, seed=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=42, ignore_eos=True)
    alone = _run(path, [prompts[0]], params)[0]
    batched = _run(path, prompts, params, max_num_batched_tokens=7)[0]
    assert alone == batched


def test_stop_conditions(tiny_model):
    path, _ = tiny_model
    llm = LLM(path, device="cpu", dtype="float32")
    prompt = _prompts(1, seed=5)[0]
    free = llm.generate([prompt], GREEDY)[0].outputs[0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    # n > 1 with a seed: independent children, reproducible
    params = SamplingParams(temperature=1.0, n=3, max_tokens=8, seed=3, ignore_eos=True)
    a = llm.generate([prompt], params)[0]
    b = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    # logprobs: the sampled token first, then the top-k
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2,
                                                ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_ids[0] == tok and lp.sampled_rank == 1 and len(lp.token_ids) == 3


def test_bad_requests(tiny_model):
    path, _ = tiny_model
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * 64], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[5]], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="0..319"):
        llm.generate([[VOCAB + 5]], GREEDY)
    # the engine is still healthy and holds no blocks
    assert llm.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished()


def test_async_scheduling_same_outputs(tiny_model):
    """Scheduling step n+1 before step n's tokens are read changes nothing a client sees:
    tokens, logprobs, finish reasons, with penalties, seeds, stops, chunking and preemption,
    nor does switching it off with a step in flight (as bench/profile_step.py does)."""
    path, _ = tiny_model
    prompts = _prompts(12, seed=6)
    stop_tok = _run(path, [prompts[0]])[0][4]
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok], logprobs=2),
        SamplingParams(temperature=0.9, top_k=20, max_tokens=9, seed=7, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, min_tokens=6, stop_token_ids=[stop_tok]),
    ]
    reqs = [(p, params[i % len(params)]) for i, p in enumerate(prompts)]

    def run(mode: str, switch_off_after: int | None = None, **kw):
        llm = LLM(path, device="cpu", dtype="float32", async_scheduling=mode, **kw)
        assert llm.engine.async_scheduling == (mode == "on")
        for p, sp in reqs:
            llm.add_request(p, sp)
        done, steps = {}, 0
        while llm.engine.has_unfinished():
            if steps == switch_off_after:  # a step in flight: the next plain step collects it
                assert llm.engine._in_flight is not None
                llm.engine.async_scheduling = False
            steps += 1
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        pool = llm.engine.scheduler.kv_manager.block_pool
        assert pool.num_free_blocks == llm.engine.executor.num_blocks
        if "num_blocks" in kw:
            assert llm.engine.stats()["num_preemptions"] > 0
        return [(o.token_ids, o.finish_reason, o.stop_reason,
                 [(lp.token_ids, lp.logprobs[0]) for lp in o.logprobs or []])
                for _, o in sorted(done.items(), key=lambda kv: int(kv[0]))]

    def same(got, want):
        """Tokens, finish and stop reasons, logprobs' token ids equal; logprobs within float32
        sums in another order (a recomputed prompt's attention is not its decodes')."""
        assert [(t, f, s, [ids for ids, _ in lps]) for t, f, s, lps in got] == \
            [(t, f, s, [ids for ids, _ in lps]) for t, f, s, lps in want]
        for (*_, g), (*_, w) in zip(got, want, strict=True):
            assert [x for _, x in g] == pytest.approx([x for _, x in w], abs=1e-4)
        return True

    ref = run("off")
    assert {r[1] for r in ref} == {"stop", "length"}
    assert same(run("on"), ref)
    assert same(run("on", max_num_batched_tokens=5), ref)  # chunked prefill mixed with decodes
    assert same(run("on", switch_off_after=4), ref)  # async scheduling switched off mid-run
    tiny = dict(num_blocks=16, block_size=4, max_model_len=64,  # preemption by recompute
                schedule_conservativeness=0)
    assert same(run("on", **tiny), ref) and same(run("off", **tiny), ref)


def test_small_cpu_steps_choose_their_threads_and_restore_them(tiny_model, monkeypatch):
    """A CPU step of at most CPU_SERIAL_TOKENS tokens runs on one thread or on all, by what its
    size measured (runner/step_threads.py: both are tried); larger steps keep the configured
    threads, and so does the process between steps; greedy tokens are those of a one-thread
    engine."""
    from skyline.worker import runner as runner_mod

    path, _ = tiny_model
    prompts = _prompts(3, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(path, device="cpu", dtype="float32")
        runner = llm.engine.executor.runner
        seen: list[tuple[int, int]] = []
        inner = runner._launch

        def spy(out, prev):
            seen.append((out.total_num_scheduled_tokens, torch.get_num_threads()))
            return inner(out, prev)

        monkeypatch.setattr(runner, "_launch", spy)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert torch.get_num_threads() == 2
        small = runner_mod.CPU_SERIAL_TOKENS
        assert {t for n, t in seen if n <= small} == {1, 2}  # each tried, then the faster
        assert {t for n, t in seen if n > small} == {2}  # the prefill of the three prompts
        assert set(runner.step_threads.summary()[3]) == {1, 2}  # 3 decodes a step, both timed
        torch.set_num_threads(1)
        assert _run(path, prompts) == tokens
    finally:
        torch.set_num_threads(before)
