"""The draft-model proposer (worker/spec/draft.py) on tiny random HF models: lossless output (greedy
identical with another model or the target as draft, through mixed prefill chunks and
preemption; seeded identical; sampled distribution-identical), full acceptance when the draft is
the target, the draft's own KV blocks freed and never over-committed, the self-draft of the
target's first layers, and the configuration errors."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import pytest
import torch
from tiny_hf import save_scaled

from skyline import LLM, SamplingParams
from skyline.config import ConfigError, ModelArch, SpecConfig
from skyline.engine.args import EngineArgs
from skyline.engine.create import check_draft_vocab, create_engine_config
from skyline.worker.spec.draft import DraftProposer, truncated_model

transformers = pytest.importorskip("transformers")

VOCAB = 320


def _build(tmp_path_factory, name: str, hidden: int = 64, layers: int = 2, vocab: int = VOCAB,
           seed: int = 0) -> str:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=vocab - 1, bos_token_id=1,
        tie_word_embeddings=False)
    return save_scaled(transformers.LlamaForCausalLM(cfg), tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return _build(tmp_path_factory, "target")


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """Another model of the same vocabulary: narrower, one layer, its own random weights."""
    return _build(tmp_path_factory, "draft", hidden=32, layers=1, seed=1)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _draft(path: str, draft: str | None = None, **kw) -> LLM:
    """An engine whose draft is verified at full depth in every step, however unsure it is
    and whatever the measured gate would say."""
    llm = LLM(path, device="cpu", dtype="float32", speculative_method="draft",
              speculative_model=draft, num_speculative_tokens=kw.pop("k", 4),
              speculative_gate=False, **kw)
    llm.engine.executor.runner.proposer.min_confidence = 0.0
    spec = llm.engine.scheduler.spec
    spec.cfg = dataclasses.replace(spec.cfg, draft_cost=0.0)
    return llm


def _proposer(llm: LLM) -> DraftProposer:
    proposer = llm.engine.executor.runner.proposer
    assert isinstance(proposer, DraftProposer)
    return proposer


def _check_freed(llm: LLM) -> None:
    proposer = llm.engine.executor.runner.proposer
    if isinstance(proposer, DraftProposer):
        llm.engine.step()  # the runner forgets the finished requests at the next step
        assert not proposer.seqs
        if proposer.pool is not None:
            assert proposer.pool.num_free_blocks == proposer.pool.num_blocks, "draft blocks leaked"
            proposer.pool.check_invariants()


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    kv = llm.engine.scheduler.kv_manager
    assert kv.block_pool.num_free_blocks == llm.engine.executor.num_blocks, "blocks leaked"
    _check_freed(llm)
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ------------------------------------------------------------------ lossless output


def test_target_and_draft_caches_share_one_budget(tiny_model, small_draft):
    """--kv-cache-memory (on a GPU, the memory budget) holds both caches, with the same token
    slots in each: blocks = budget // (target bytes + draft bytes per block)."""
    from skyline.worker.kv_cache import bytes_per_block

    budget = 1 << 20
    llm = _draft(tiny_model, small_draft, kv_cache_memory=budget, max_model_len=512,
                 max_num_seqs=64)
    runner = llm.engine.executor.runner
    p = _proposer(llm)
    target_b = bytes_per_block(runner.arch, runner.block_size, runner.kv_dtype)
    draft_b = p.kv_bytes_per_block(runner.block_size)
    assert 0 < draft_b < target_b  # the smaller model's
    assert runner.num_blocks == budget // (target_b + draft_b)
    _run(llm, _prompts(2, seed=1), GREEDY)
    assert p.pool is not None and p.pool.num_blocks == runner.num_blocks
    assert runner.num_blocks * (target_b + draft_b) <= budget


def test_greedy_identical_with_a_smaller_draft_model(tiny_model, small_draft):
    prompts = _prompts(10, seed=1)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, GREEDY)
    llm = _draft(tiny_model, small_draft)
    assert _run(llm, prompts, GREEDY) == ref
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    p = _proposer(llm)
    assert p.arch.hidden_size == 32 and p.pool is not None
    assert p.block_size == 16 and p.pool.num_blocks >= 10  # the target's token slots
    # prefill chunks of 5 tokens mixed with verifications in one batch
    llm = _draft(tiny_model, small_draft, max_num_batched_tokens=5)
    assert _run(llm, prompts, GREEDY) == ref
    # preemption: the runner forgets a preempted request; its draft blocks go back
    llm = _draft(tiny_model, small_draft, num_blocks=24, block_size=4, max_model_len=96,
                 schedule_conservativeness=0)
    assert _run(llm, prompts, GREEDY) == ref
    assert llm.engine.stats()["num_preemptions"] > 0
    assert _proposer(llm).block_size == 4


def test_target_as_draft_accepts_everything(tiny_model):
    """The target drafting for itself: every draft is the target's own greedy token."""
    prompts = _prompts(6, seed=2)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, GREEDY)
    for kw in (dict(draft=tiny_model), dict(speculative_draft_layers=2)):
        llm = _draft(tiny_model, k=4, **kw)
        assert _run(llm, prompts, GREEDY) == ref
        stats = llm.engine.stats()
        assert stats["spec_acceptance_rate"] > 0.97, stats
        assert stats["spec_mean_accepted_length"] > 4.5, stats  # of at most 1 + 4


def test_self_draft_of_the_first_layers(tiny_model):
    prompts = _prompts(6, seed=4)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, GREEDY)
    llm = _draft(tiny_model, speculative_draft_layers=1)
    assert _run(llm, prompts, GREEDY) == ref
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    target = llm.engine.executor.runner.model
    draft = _proposer(llm).model
    assert len(draft.model.layers) == 1 and draft.arch.num_layers == 1
    assert len(target.model.layers) == 2  # the target is untouched
    # every weight shared, every attention layer (and so its KV cache) its own
    t_params = dict(target.named_parameters())
    for name, p in draft.named_parameters():
        assert p is t_params[name], name
    d_attn, t_attn = draft.attention_layers()[0], target.attention_layers()[0]
    assert d_attn is not t_attn and d_attn.kv_cache is not t_attn.kv_cache
    # all layers: the same function as the target
    full = truncated_model(target, 2)
    ids, pos = torch.tensor([5, 9, 3, 7]), torch.arange(4)
    with torch.inference_mode():
        torch.testing.assert_close(full(ids, pos), target(ids, pos))


def test_seeded_sampling_unchanged(tiny_model, small_draft):
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.1, max_tokens=20,
                            seed=7, ignore_eos=True)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, params)
    for draft in (small_draft, tiny_model):
        llm = _draft(tiny_model, draft)
        assert _run(llm, prompts, params) == ref
        stats = llm.engine.stats()
        assert stats["spec_num_draft_tokens"] > 0
        assert draft != tiny_model or stats["spec_num_accepted_tokens"] > 0


def test_sampled_output_follows_the_target_distribution(tiny_model, pair_law):
    """Chi-square on the first two output tokens of many unseeded requests: the second one is
    verified against the draft's greedy token (the target's own argmax, so often accepted);
    their joint law must be the target's."""
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    llm = LLM(tiny_model, device="cpu", dtype="float32")
    cells, probs = pair_law.law(llm, prompt)
    n = 2000
    llm = _draft(tiny_model, tiny_model, k=1, max_num_seqs=256,
                 speculative_max_batch_tokens=4096)
    _proposer(llm).max_batch = 4096
    outs = _run(llm, [prompt] * n, params)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.2 * n  # drafts were verified and accepted
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    pair_law.check(outs, cells, probs)


# ------------------------------------------------------------------ the draft's KV blocks


def test_full_draft_pool_proposes_nothing(tiny_model, small_draft):
    """A pool of 3 blocks (48 slots): requests that do not fit get no drafts, never an error,
    and the output stays the target's."""
    prompts = _prompts(8, seed=5)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, GREEDY)
    llm = _draft(tiny_model, small_draft)
    p = _proposer(llm)
    p.num_blocks = 3  # before first use, when the pool is allocated
    assert _run(llm, prompts, GREEDY) == ref
    assert p.pool is not None and p.pool.num_blocks == 3
    assert 0 < llm.engine.stats()["spec_num_draft_tokens"]

    # directly: a request of 40 tokens and depth 4 needs 43 slots (3 blocks), a second one
    # finds the pool empty
    long = list(range(2, 42))
    drafts = p.propose(["a", "b"], [long, long], 4)
    assert len(drafts[0]) == 4 and drafts[1] == []
    assert p.pool.num_free_blocks == 0 and len(p.seqs["a"].blocks) == 3
    assert not p.seqs["b"].blocks
    # accepted drafts keep their KV: only the bonus token is fed next time
    p.propose(["a"], [long + drafts[0][:2] + [7]], 2)
    assert p.seqs["a"].state.num_computed_tokens == len(long) + 3
    p.finish("a", [])
    p.finish("b", [])
    assert p.pool.num_free_blocks == 3 and not p.seqs


def test_abort_frees_draft_blocks(tiny_model, small_draft):
    llm = _draft(tiny_model, small_draft)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in _prompts(4, seed=6)]
    for _ in range(6):
        llm.step()
    p = _proposer(llm)
    assert p.pool is not None and p.pool.num_free_blocks < p.pool.num_blocks
    for rid in ids:
        llm.abort(rid)
    while llm.engine.has_unfinished():
        llm.step()
    _check_freed(llm)


# ------------------------------------------------------------------ configuration


def _arch(**kw) -> ModelArch:
    base = dict(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64,
                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                bos_token_id=1, eos_token_ids=(VOCAB - 1,))
    return ModelArch(**(base | kw))


def test_config_errors(tiny_model):
    with pytest.raises(ConfigError, match="--speculative-draft-layers N"):
        SpecConfig(method="draft")
    with pytest.raises(ConfigError, match="needs --speculative-method draft"):
        SpecConfig(method="ngram", draft_layers=2)
    assert SpecConfig(method="draft", draft_layers=1).enabled
    with pytest.raises(ConfigError, match="more than the target's 2 layers"):
        create_engine_config(EngineArgs(model=tiny_model, device="cpu",
                                        speculative_method="draft", speculative_draft_layers=3))
    with pytest.raises(ConfigError, match="not both"):
        create_engine_config(EngineArgs(model=tiny_model, device="cpu",
                                        speculative_method="draft", speculative_model=tiny_model,
                                        speculative_draft_layers=1))
    cfg, _ = create_engine_config(EngineArgs(model=tiny_model, device="cpu", dtype="float32",
                                             speculative_method="draft",
                                             speculative_model=tiny_model))
    assert cfg.spec.draft is not None and cfg.spec.draft.dtype == "float32"
    assert cfg.spec.draft.load_format == "safetensors"
    check_draft_vocab(_arch(hidden_size=32), _arch(), "d")
    with pytest.raises(ConfigError, match="bos_token_id 0, the target's is 1"):
        check_draft_vocab(_arch(bos_token_id=0), _arch(), "d")
    with pytest.raises(ConfigError, match="eos_token_id"):
        check_draft_vocab(_arch(eos_token_ids=(5,)), _arch(), "d")


def test_vocab_mismatch_is_one_line(tiny_model, tmp_path_factory):
    other = _build(tmp_path_factory, "other-vocab", hidden=32, layers=1, vocab=256)
    r = subprocess.run([sys.executable, "-m", "skyline.cli", "generate", "--model", tiny_model,
                        "--speculative-method", "draft", "--speculative-model", other, "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("skyline: error:"), r.stderr
    assert "vocab_size 256, the target's is 320" in lines[0] and "same family" in lines[0]
