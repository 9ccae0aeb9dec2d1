"""The multi-process executor with the other features (gloo on the CPU, fp32): a MoE model's
experts each split over tensor-parallel ranks, whole experts spread over 2 and 4
expert-parallel ranks (tokens moved by all-to-all; chunked prefill, prefix hits, preemption)
and layers cut into pipeline stages give one process's greedy tokens and prompt logprobs, and
a rank dying amid the all-to-alls stops the engine with one error; gpt-oss gives them too at
TP=2 (sinks, windows, expert biases); the KV tiers run on every rank (each over its own shard
of a block) and a prefix restored from host RAM gives the same tokens; the queries answer
through the ranks; what does not combine is refused with one sentence."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import prefix_prompts, save_scaled

from skyline import LLM, SamplingParams
from skyline.config import ConfigError

transformers = pytest.importorskip("transformers")

VOCAB = 320
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A rank silent for 60 s stops the engine: a test fails, never hangs.
SMALL = dict(device="cpu", dtype="float32", block_size=4, num_blocks=48, max_model_len=96,
             max_num_batched_tokens=16, max_num_seqs=8, distributed_timeout=60,
             schedule_conservativeness=0)  # preemption by recompute


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """5 experts: 3 + 2 and 2 + 1 + 1 + 1 whole experts over 2 and 4 expert-parallel ranks;
    32 intermediate features, 16 of each expert on each of 2 tensor-parallel ranks."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, intermediate_size=96,
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        eos_token_id=VOCAB - 1, bos_token_id=1, tie_word_embeddings=False)
    return save_scaled(transformers.Qwen3MoeForCausalLM(cfg), tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """Attention sinks (one per head: split over the ranks with the heads), sliding windows,
    4 experts."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, eos_token_id=VOCAB - 1,
        bos_token_id=1, tie_word_embeddings=False)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks large enough to change the tokens
        for name, p in model.named_parameters():
            p.normal_(0, 3.0 if name.endswith("sinks") else 0.15)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.eval().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    return prefix_prompts(VOCAB, 8, 32, (4, 24))


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _prompt_logprobs(llm: LLM, prompts) -> list:
    """Each prompt token's logprob and top 2 (SamplingParams.prompt_logprobs), over a
    prefill in chunks (and micro-batches across stages)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    return [[(lp.token_ids, lp.logprobs) for lp in o.prompt_logprobs[1:]]
            for o in llm.generate(prompts[:3], params)]


@pytest.fixture(scope="module")
def moe_ref(moe, prompts):
    llm = LLM(moe, **SMALL)
    return (_tokens(llm, prompts), llm.engine.executor.query("model_cost").expert_bytes,
            _prompt_logprobs(llm, prompts))


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(pipeline_parallel_size=2),
                                    dict(tensor_parallel_size=2, expert_parallel=True),
                                    dict(tensor_parallel_size=4, expert_parallel=True)])
def test_moe_across_ranks(moe, prompts, moe_ref, layout):
    ep = layout.get("expert_parallel", False)
    # with expert parallelism half the blocks: requests are preempted and recomputed
    llm = LLM(moe, **SMALL | dict(num_blocks=24 if ep else SMALL["num_blocks"]), **layout)
    try:
        assert _tokens(llm, prompts) == moe_ref[0]
        if ep:  # the second round reads its prefixes from cache
            again = llm.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in again] == moe_ref[0]
            assert sum(o.num_cached_tokens for o in again) > 0
            assert llm.engine.stats()["num_preemptions"] > 0
        # each rank holds its own experts only: together, the model's (and the expert maps)
        got = llm.engine.executor.query("model_cost").expert_bytes
        assert moe_ref[1] <= got < moe_ref[1] * 1.01
        got_lps = _prompt_logprobs(llm, prompts)
        assert [[ids for ids, _ in p] for p in got_lps] == [[ids for ids, _ in p]
                                                            for p in moe_ref[2]]
        torch.testing.assert_close([[lps for _, lps in p] for p in got_lps],
                                   [[lps for _, lps in p] for p in moe_ref[2]],
                                   rtol=1e-4, atol=1e-4)
    finally:
        llm.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_expert_parallel_over_nccl(moe, prompts):
    """Two GPUs: the all-to-alls over NCCL (counts read on the host, the engine eager)."""
    gpu = SMALL | dict(device="cuda")
    want = _tokens(LLM(moe, **gpu), prompts)
    llm = LLM(moe, **gpu, tensor_parallel_size=2, expert_parallel=True)
    try:
        assert llm.config.enforce_eager and llm.config.parallel.expert_parallel
        assert _tokens(llm, prompts) == want
    finally:
        llm.shutdown()


def test_a_rank_dying_amid_expert_parallel_stops_the_engine(moe, prompts):
    import os
    import signal
    import time

    from skyline.worker.executor.multiproc import RankError

    holder: list[LLM] = []
    steps = []

    def kill_after_three_steps(out, scheduled_at, seconds):
        steps.append(1)
        if len(steps) == 3:
            os.kill(holder[0].engine.executor.procs[1].pid, signal.SIGKILL)

    llm = LLM(moe, **SMALL, tensor_parallel_size=2, expert_parallel=True,
              observers=[kill_after_three_steps])
    holder.append(llm)
    t = time.monotonic()
    with pytest.raises(RankError, match=r"^rank 1 \(pid \d+\) was killed by SIGKILL; the engine "
                                        r"stopped$"):
        llm.generate(prompts, GREEDY)
    assert time.monotonic() - t < 30
    assert not any(p.is_alive() for p in llm.engine.executor.procs.values())
    llm.shutdown()


def test_gpt_oss_tensor_parallel(gpt_oss, prompts):
    want = _tokens(LLM(gpt_oss, **SMALL), prompts)
    llm = LLM(gpt_oss, **SMALL, tensor_parallel_size=2)
    try:
        assert _tokens(llm, prompts) == want
    finally:
        llm.shutdown()


def test_kv_tiers_and_queries_across_ranks(tiny_llama, tmp_path):
    path = tiny_llama(0.15)
    # more than the device's 48 blocks: the second round finds their prefixes in host RAM
    prompts = prefix_prompts(VOCAB, 10, 40, (10, 40), seed=1)
    one = LLM(path, **SMALL, kv_offload_ram="1MiB")
    want = [_tokens(one, prompts), _tokens(one, prompts)]
    assert one.engine.stats()["kv_offload_ram_hit_tokens"] > 0
    ids = prompts[0]
    want_score = one.engine.executor.query("score", ids)
    want_scales = one.engine.executor.query("kv_scales")
    llm = LLM(path, **SMALL, kv_offload_ram="1MiB", kv_offload_disk=str(tmp_path),
              tensor_parallel_size=2)
    try:
        assert [_tokens(llm, prompts), _tokens(llm, prompts)] == want
        stats = llm.engine.stats()
        assert stats["kv_offload_ram_hit_tokens"] > 0
        pool = llm.engine.scheduler.kv_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        ex = llm.engine.executor
        info = ex.query("kv_connector_info")
        assert info["ram_slots"] > 0
        torch.testing.assert_close(ex.query("score", ids), want_score, rtol=1e-4, atol=1e-4)
        assert ex.query("kv_scales") == want_scales
        assert len(ex.query("hidden_states", [ids])[0]) == len(ids)
        with pytest.raises(ConfigError, match="needs the whole model in one process"):
            ex.query("collect_act_sq", ids)
    finally:
        llm.shutdown()


def test_refused_combinations(tiny_llama):
    path = tiny_llama(0.15)
    with pytest.raises(ConfigError, match="a prefill replica runs on one rank"):
        LLM(path, **SMALL, role="prefill", tensor_parallel_size=2)
