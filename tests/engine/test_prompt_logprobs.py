"""Prompt logprobs from the prefill pass (SamplingParams.prompt_logprobs) against Hugging Face
transformers' log-softmax on a tiny random model (fp32): whole or chunked prefill, a prompt
whose prefix is cached (scored anyway), preemption in mid-prefill, n > 1, and the same numbers
as LLM.score."""

from __future__ import annotations

import random

import pytest
import torch

from skyline import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 320
K = 3


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    path = tiny_llama(0.15, vocab_size=VOCAB)  # eos VOCAB - 1, bos 1
    return path, transformers.LlamaForCausalLM.from_pretrained(path).eval()


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [n, vocab]


def _check(out, ids: list[int], ref: torch.Tensor) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for j in range(1, len(ids)):
        e, row = lps[j], ref[j - 1]
        assert e.token_ids[0] == ids[j]
        assert abs(e.logprobs[0] - row[ids[j]].item()) < 1e-4
        assert e.sampled_rank == int((row > row[ids[j]]).sum()) + 1
        top = row.topk(K)
        assert e.token_ids[1:] == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(e.logprobs[1:], top.values.tolist(),
                                              strict=True)) < 1e-4


def test_prompt_logprobs_match_hf(tiny):
    path, hf = tiny
    rng = random.Random(0)
    shared = [rng.randrange(2, VOCAB - 1) for _ in range(24)]
    prompts = [shared + [rng.randrange(2, VOCAB - 1) for _ in range(n)] for n in (9, 17)]
    prompts.append([5])  # one token: nothing to score
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K, ignore_eos=True)
    # chunks of 7 tokens; the second prompt's prefix is cached by the first's, block size 4
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=7, block_size=4)
    first = llm.generate(prompts[:1], params)[0]
    rest = llm.generate(prompts[1:], [params, SamplingParams(temperature=0.0, max_tokens=2,
                                                             prompt_logprobs=0, n=2)])
    _check(first, prompts[0], _reference(hf, prompts[0]))
    _check(rest[0], prompts[1], _reference(hf, prompts[1]))
    assert rest[1].prompt_logprobs == [None] and len(rest[1].outputs) == 2
    # the same numbers as LLM.score (teacher forcing outside the KV cache)
    scored = torch.cat(llm.score(prompts[1]))
    for j in range(1, len(prompts[1])):
        assert abs(rest[0].prompt_logprobs[j].logprobs[0]
                   - scored[j - 1, prompts[1][j]].item()) < 1e-4
    # every KV block back, prefix hits counted for requests that do not score their prompt
    assert llm.engine.scheduler.kv_manager.block_pool.num_free_blocks == llm.num_blocks


def test_prompt_logprobs_survive_preemption(tiny):
    """A cache too small for every prompt at once: prefills are preempted and recomputed, and
    each prompt token's logprob is still reported once."""
    path, hf = tiny
    rng = random.Random(1)
    prompts = [[rng.randrange(2, VOCAB - 1) for _ in range(30)] for _ in range(4)]
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=18, block_size=4,
              max_model_len=64, max_num_batched_tokens=12, schedule_conservativeness=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                prompt_logprobs=K, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for out, ids in zip(outs, prompts, strict=True):
        _check(out, ids, _reference(hf, ids))
