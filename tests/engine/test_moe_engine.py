"""Mixture-of-experts models in the engine: greedy tokens equal Hugging Face transformers' and
do not change with batching, chunked prefill, prefix reuse or preemption (fp32, tiny random
Qwen3-MoE and gpt-oss models; gpt-oss's sliding window of 8 tokens is shorter than the
prompts)."""

from __future__ import annotations

import pytest
import torch
from test_engine_invariance import GREEDY, VOCAB, _prompts, _run, check_invariance

from skyline import LLM

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_model(request, tmp_path_factory):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  eos_token_id=VOCAB - 1, bos_token_id=1, tie_word_embeddings=False)
    if request.param == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=96, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.GptOssConfig(**common, intermediate_size=32, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=8)
        model = transformers.GptOssForCausalLM(cfg)
    # Larger weights than the default init, so greedy decoding is not one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(request.param)
    model.eval().save_pretrained(path, safe_serialization=True)
    return str(path), model


def test_greedy_matches_hf_generate(moe_model):
    path, hf = moe_model
    prompts = _prompts(3, seed=1)
    for p, toks in zip(prompts, _run(path, prompts), strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
        assert toks == ref[0, len(p):].tolist()


def test_batch_chunk_prefix_preempt_invariance(moe_model):
    check_invariance(moe_model[0], 8, 2, 24, 4)


def _cost_and_tokens(path: str, prompts, **kw) -> tuple:
    llm = LLM(path, dtype="float32", **kw)
    try:
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        info = llm.engine.executor.describe()
        assert (info["host_experts_gib"] > 0) == (kw.get("n_cpu_moe", 0) > 0)
        return llm.query("model_cost"), toks, llm.config
    finally:
        llm.shutdown()


def test_experts_of_the_first_layer_in_host_memory(moe_model):
    """--n-cpu-moe 1 on a CPU: the first layer's experts are held as host experts (nothing
    moves) and the tokens are the same."""
    prompts = _prompts(3, seed=1)
    cost, toks, _ = _cost_and_tokens(moe_model[0], prompts, device="cpu", n_cpu_moe=1)
    assert cost.host_expert_bytes * 2 == cost.expert_bytes > 0  # one layer of two
    assert toks == _run(moe_model[0], prompts)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_experts_on_the_cpu_beside_the_gpu(moe_model):
    """The real split: the first layer's experts in host memory, run by the CPU, the rest on
    the GPU, eagerly; the same greedy tokens as all on the GPU (fp32)."""
    prompts = _prompts(3, seed=1)
    gpu = dict(device="cuda", num_blocks=64, max_model_len=256)  # a cache of its own size
    _, want, _ = _cost_and_tokens(moe_model[0], prompts, **gpu)
    cost, toks, cfg = _cost_and_tokens(moe_model[0], prompts, **gpu, n_cpu_moe=1)
    assert cfg.enforce_eager and cfg.parallel.n_cpu_moe == 1
    assert cost.host_expert_bytes * 2 == cost.expert_bytes > 0
    assert toks == want
