"""The EAGLE head and proposer (worker/spec/eagle.py, eagle_proposer.py) on tiny random HF
models: shapes and the head's KV bookkeeping, training-time unrolling equal to drafting,
lossless output (greedy identical, seeded identical, sampled distribution-identical), and
`skyline train-speculator` end to end with its errors."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys

import pytest
import torch

from skyline import LLM, SamplingParams
from skyline.config import ConfigError, SpecConfig, TrainArgs
from skyline.worker.spec.eagle import (
    AttnPlan,
    build_head,
    init_head,
    load_head,
    save_head,
    target_parts,
)
from skyline.worker.spec.eagle_proposer import EagleProposer
from skyline.worker.spec.head_cache import PAGE, HeadCache, HeadKVPool
from skyline.worker.spec.train import train_head

transformers = pytest.importorskip("transformers")

VOCAB = 320


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    return tiny_llama(0.15)


def _target(path: str):
    llm = LLM(path, device="cpu", dtype="float32")
    return llm, llm.engine.executor.runner.model


@pytest.fixture(scope="module")
def random_head(tiny_model, tmp_path_factory):
    """An untrained head over the whole vocabulary: the training start, perturbed so that
    attention and MLP are not the no-ops they start as."""
    _, model = _target(tiny_model)
    head = build_head(model, VOCAB, torch.float32)
    init_head(head, model, seed=1)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    head.vocab_ids.copy_(torch.arange(VOCAB))
    path = str(tmp_path_factory.mktemp("head"))
    save_head(path, head, {"note": "untrained"}, dtype=torch.float32)
    return path


def test_init_head_starts_from_the_served_targets_last_layer(tiny_model):
    # On the CPU the engine packs the target's Linears for oneDNN (no dense `weight`): the
    # head still starts as the target's last layer, output projections zeroed.
    _, model = _target(tiny_model)
    last = model.model.layers[-1]
    assert "weight" not in dict(last.self_attn.qkv_proj.named_parameters())  # packed
    head = build_head(model, VOCAB, torch.float32)
    init_head(head, model, seed=3)
    assert torch.equal(head.layer.self_attn.qkv_proj.weight, last.self_attn.qkv_proj.full_weight())
    assert torch.equal(head.layer.mlp.gate_up_proj.weight, last.mlp.gate_up_proj.full_weight())
    assert not head.layer.self_attn.o_proj.weight.any()
    assert not head.layer.mlp.down_proj.weight.any()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _eagle(path: str, head: str, always_draft: bool = True, **kw) -> LLM:
    if always_draft:  # every step speculates, whatever the measured gate would say
        kw.setdefault("speculative_gate", False)
    llm = LLM(path, device="cpu", dtype="float32", speculative_method="eagle",
              speculative_model=head, num_speculative_tokens=kw.pop("k", 4), **kw)
    if always_draft:  # verify every draft, however unlikely the head thinks it is
        llm.engine.executor.runner.proposer.min_confidence = 0.0
        spec = llm.engine.scheduler.spec
        spec.cfg = dataclasses.replace(spec.cfg, draft_cost=0.0)
    return llm


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    kv = llm.engine.scheduler.kv_manager
    assert kv.block_pool.num_free_blocks == llm.engine.executor.num_blocks, "blocks leaked"
    proposer = llm.engine.executor.runner.proposer
    if isinstance(proposer, EagleProposer):
        llm.engine.step()  # the runner forgets the finished requests at the next step
        assert not proposer.caches and not proposer.pending and not proposer.last
    return outs


# ------------------------------------------------------------------ head and bookkeeping


def test_head_shapes_and_cache_bookkeeping(tiny_model, random_head):
    _, model = _target(tiny_model)
    head = load_head(random_head, model)
    assert head.vocab_ids.tolist() == list(range(VOCAB)) and not head.training
    assert head.fc.weight.shape == (64, 128) and head.fc.weight.dtype == torch.float32
    parts = target_parts(model, head.vocab_ids)
    feats = torch.randn(5, 64)
    pool = HeadKVPool(2, 16, torch.float32, torch.device("cpu"), num_pages=1)
    cache, other = HeadCache(0, pool), HeadCache(0, pool)
    other.reserve(3)
    cache.reserve(PAGE + 5)  # the pool doubles twice, the pages already taken keep their rows
    assert pool.kv.shape == (2, 4, PAGE, 2, 16) and len(cache.pages) == 2
    assert sorted(other.pages + cache.pages + pool.free) == [0, 1, 2, 3]
    other.release()
    assert not other.pages and len(pool.free) == 2
    g = head(parts.embed(torch.tensor([3, 4, 5, 6, 7])), feats, torch.arange(5),
             AttnPlan([5], [cache], [0]))
    assert g.shape == (5, 64) and parts.logits(parts.norm(g)).shape == (5, VOCAB)

    prop = EagleProposer(SpecConfig(method="eagle", model=random_head, draft_cost=0.0), model)
    tokens = [5, 6, 7, 8, 9, 10]
    # prefill chunk of 4 (positions 0..3): every next token is a prompt token -> fed now
    prop.observe(["a"], [0], [torch.randn(4, 64)], [tokens])
    c = prop.caches["a"]
    assert (c.base, c.length) == (0, 4) and "a" not in prop.pending
    # last chunk (positions 4, 5): position 5's next token is the one about to be sampled
    prop.observe(["a"], [4], [torch.randn(2, 64)], [tokens])
    assert c.length == 5 and prop.pending["a"][0] == 5
    tokens.append(11)  # sampled
    drafts = prop.propose(["a"], [tokens], 3)[0]
    assert c.length == 6 and "a" not in prop.pending and len(drafts) == 3
    assert len(c.pages) * PAGE >= 6 + 2  # drafting wrote scratch rows past the committed ones
    # a verification of the 3 drafts (4 rows from position 6) that accepts one of them
    prop.observe(["a"], [6], [torch.randn(4, 64)], [tokens])
    assert c.length == 6
    tokens += [drafts[0], 99]  # the accepted draft and the correction
    prop.propose(["a"], [tokens], 2)
    assert c.length == 8  # rows of positions 6 and 7 kept, the two rejected ones dropped
    # a request whose first 16 tokens came from the prefix cache starts its head there
    prop.observe(["b"], [16], [torch.randn(3, 64)], [list(range(20))])
    assert (prop.caches["b"].base, prop.caches["b"].length) == (16, 3)
    # many requests at once: no drafts (the scheduler would not speculate), still fed
    many = [f"r{i}" for i in range(20)]
    prop.observe(many, [0] * 20, [torch.randn(2, 64)] * 20, [[1, 2]] * 20)
    assert prop.propose(many, [[1, 2, 3]] * 20, 3) == [[]] * 20
    assert all(prop.caches[r].length == 2 for r in many)
    # a request repeating itself (its last 5 tokens occurred before): prompt lookup drafts
    rep = [7, 8, 9, 10, 11, 12, 13, 14, 7, 8, 9, 10, 11]
    prop.observe(["c"], [0], [torch.randn(len(rep) - 1, 64)], [rep])
    assert prop.propose(["c"], [rep], 3) == [[12, 13, 14]]
    assert prop.caches["c"].length == len(rep) - 1  # the head was still fed
    for r in ["a", "b", "c", *many]:
        prop.finish(r, [])
    assert not prop.caches and not prop.pending and not prop.last
    assert len(prop.pool.free) == prop.pool.num_pages  # every page back
    assert not prop.lookup.indexes


def test_unrolled_training_pass_attends_like_drafting(tiny_model, random_head):
    """Pass 1 of training at position t equals a drafting step at t after the head was fed
    the target's features of positions 0..t-1 (the training-time test is exact)."""
    _, model = _target(tiny_model)
    head = load_head(random_head, model)
    parts = target_parts(model, head.vocab_ids)
    torch.manual_seed(0)
    n = 21  # past one page of the head cache
    feats, toks = torch.randn(n, 64), torch.randint(0, VOCAB, (n,))
    emb, pos = parts.embed(toks), torch.arange(n)
    head.train()  # the reference (autograd) path
    with torch.no_grad():
        out0 = parts.norm(head(emb, feats, pos, AttnPlan([n])))
        kv0 = head.attn.last_kv
        shifted = torch.cat([feats[:1], out0[:-1]])
        out1 = parts.norm(head(emb, shifted, pos, AttnPlan([n], prev_kv=[kv0])))
    head.eval()
    for t in range(1, n):
        pool = HeadKVPool(2, 16, torch.float32, torch.device("cpu"), num_pages=1)
        HeadCache(0, pool).reserve(3)  # another request's page first: this one's are not 0..
        cache = HeadCache(0, pool)
        ctx = head(emb[:t], feats[:t], pos[:t], AttnPlan([t], [cache], [0]))
        torch.testing.assert_close(parts.norm(ctx), out0[:t], atol=1e-5, rtol=1e-5)
        step = head(emb[t : t + 1], out0[t - 1 : t], pos[t : t + 1], AttnPlan([1], [cache], [t]))
        torch.testing.assert_close(parts.norm(step)[0], out1[t], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ lossless output


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_greedy_identical_with_untrained_head(tiny_model, random_head):
    prompts = _prompts(10, seed=1)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, GREEDY)
    llm = _eagle(tiny_model, random_head, eagle_lookup=False)  # every draft from the head
    assert _run(llm, prompts, GREEDY) == ref
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    # one request alone; prefill chunks of 5 mixed with verifications; preemption
    assert _run(_eagle(tiny_model, random_head), prompts[:1], GREEDY) == ref[:1]
    llm = _eagle(tiny_model, random_head, max_num_batched_tokens=5)
    assert _run(llm, prompts, GREEDY) == ref
    llm = _eagle(tiny_model, random_head, num_blocks=24, block_size=4, max_model_len=96,
                 schedule_conservativeness=0)
    assert _run(llm, prompts, GREEDY) == ref
    assert llm.engine.stats()["num_preemptions"] > 0


def test_plain_stretches_keep_the_head_fed(tiny_model, random_head):
    """With the gate switching between plain and speculative steps at random, the head is
    still fed every position (no gap in its cache: plain steps draft nothing but resolve the
    pending rows), and greedy output is unchanged."""
    prompts = _prompts(8, seed=3)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, GREEDY)
    llm = _eagle(tiny_model, random_head, eagle_lookup=False, speculative_gate=True)
    rng = random.Random(2)
    llm.engine.scheduler.spec.gate.choose = lambda n: rng.random() < 0.5
    prop = llm.engine.executor.runner.proposer
    gaps, feed = [], prop._feed

    def spy(items):
        for rid, start, _, _ in items:
            c = prop.caches.get(rid)
            if c is not None and not c.base <= start <= c.base + c.length:
                gaps.append((rid, start))
        feed(items)

    prop._feed = spy
    assert _run(llm, prompts, GREEDY) == ref
    stats = llm.engine.stats()
    assert not gaps and stats["spec_num_draft_tokens"] > 0
    assert 0.25 < stats["spec_gate_speculated_fraction"] < 0.75


def test_the_head_is_not_fed_past_the_static_bound(tiny_model, random_head):
    """While the batch is too large for any step to verify drafts, the head skips the step's
    rows (feeding it cost ~10% of a CPU step for nothing); once the batch shrinks within the
    bound it restarts its caches and drafts again; greedy output is unchanged."""
    prompts = _prompts(8, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 6 * i, ignore_eos=True)
              for i in range(8)]
    ref = [o.outputs[0].token_ids
           for o in LLM(tiny_model, device="cpu", dtype="float32").generate(prompts, params)]
    llm = _eagle(tiny_model, random_head, eagle_lookup=False, speculative_max_batch_tokens=4)
    prop = llm.engine.executor.runner.proposer
    fed, observe = [], prop.observe

    def spy(req_ids, *args):
        fed.append(len(req_ids))
        observe(req_ids, *args)

    prop.observe = spy
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert fed and max(fed) <= 5  # never while 6 or more requests decode
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


@pytest.fixture(scope="module")
def trained_head(tiny_model, tmp_path_factory):
    """A head trained briefly on the tiny model's own greedy continuations (the API path of
    `skyline train-speculator`); returns (path, stats)."""
    from skyline.tools.speculator.data import Example, record

    llm = LLM(tiny_model, device="cpu", dtype="float32", enable_prefix_caching=False)
    examples = [Example(p) for p in _prompts(24, seed=5)]
    samples = record(llm, examples, max_tokens=24)
    assert len(samples) == 24
    s = samples[0]
    assert s.feats.shape == (len(s.token_ids) - 1, 64)  # the last token was never computed
    # the recorded features are the target's own: its logits there are the greedy tokens
    logits = llm.engine.executor.runner.model.compute_logits(s.feats[s.num_prompt - 1 :])
    assert logits.argmax(-1).tolist() == s.token_ids[s.num_prompt :]
    model = llm.engine.executor.runner.model
    head, stats = train_head(model, samples, TrainArgs(steps=30, lr=3e-3, batch_tokens=256,
                                                       unroll=2, draft_vocab=VOCAB))
    path = str(tmp_path_factory.mktemp("trained"))
    save_head(path, head, {"training": stats})
    return path, stats


def test_training_reduces_the_loss_and_the_head_loads(tiny_model, trained_head):
    path, stats = trained_head
    assert stats["steps"] == 30
    assert stats["last_loss"] < stats["first_loss"]
    assert stats["val_after"]["loss"] < stats["val_before"]["loss"]
    cfg = json.load(open(f"{path}/config.json"))
    assert cfg["hidden_size"] == 64 and cfg["draft_vocab_size"] == VOCAB
    _, model = _target(tiny_model)
    assert load_head(path, model).fc.weight.dtype == torch.float32


def test_seeded_sampling_unchanged(tiny_model, trained_head):
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.1, max_tokens=20,
                            seed=7, ignore_eos=True)
    ref = _run(LLM(tiny_model, device="cpu", dtype="float32"), prompts, params)
    llm = _eagle(tiny_model, trained_head[0])
    assert _run(llm, prompts, params) == ref
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_sampled_output_follows_the_target_distribution(tiny_model, tmp_path, pair_law):
    """Chi-square on the first two output tokens of many unseeded requests: the second one is
    verified against the head's draft; their joint law must be the target's."""
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    llm, model = _target(tiny_model)
    # The target's law of (t1, t2) under top-k 3.
    cells, probs = pair_law.law(llm, prompt)
    # An untrained head whose draft vocabulary is the candidates for t2: its drafts are often
    # among the target's top 3, so the accepting side of verification is exercised too.
    vocab = sorted({b for _, b in cells})
    head = build_head(model, len(vocab), torch.float32)
    init_head(head, model, seed=2)
    head.vocab_ids.copy_(torch.tensor(vocab))
    save_head(str(tmp_path), head, {}, dtype=torch.float32)
    n = 3000
    llm = _eagle(tiny_model, str(tmp_path), k=1, max_num_seqs=256,
                 speculative_max_batch_tokens=4096)
    llm.engine.executor.runner.proposer.max_batch = 4096
    outs = _run(llm, [prompt] * n, params)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.03 * n  # drafts were verified and accepted
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    pair_law.check(outs, cells, probs)


# ------------------------------------------------------------------ CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skyline.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_train_speculator_cli_and_errors(tiny_model, tmp_path, tiny_llama):
    prompts = tmp_path / "p.jsonl"
    rng = random.Random(0)
    with open(prompts, "w") as f:
        for i in range(8):
            toks = [rng.randrange(2, VOCAB - 1) for _ in range(6)]
            f.write(json.dumps({"prompt": toks, "completion": toks * 3} if i % 2
                               else {"prompt": toks, "max_tokens": 12}) + "\n")
    out = tmp_path / "head"
    r = _cli("train-speculator", "--model", tiny_model, "--prompts", str(prompts),
             "--out", str(out), "--steps", "3", "--batch-tokens", "64", "--draft-vocab", "50")
    assert r.returncode == 0, r.stderr
    assert "held-out loss" in r.stdout and (out / "head.safetensors").is_file()
    assert json.load(open(out / "config.json"))["draft_vocab_size"] == 50

    # errors are one line each, no traceback
    def one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        # "skyline: error:", or "skyline train-speculator: error:" for a flag's bad value
        assert len(lines) == 1 and re.match(r"skyline( [a-z-]+)?: error:", lines[0]), r.stderr
        assert all(w in lines[0] for w in words), lines[0]

    gen = ["generate", "--model", tiny_model, "--speculative-method", "eagle"]
    one_line_error(_cli(*gen, "--raw", "1 2 3"), "--speculative-model")
    one_line_error(_cli(*gen, "--speculative-model", str(tmp_path / "nope"), "x"),
                   "train-speculator")
    other = tiny_llama(0.15, "wide", hidden_size=96)
    one_line_error(_cli("generate", "--model", other, "--speculative-method", "eagle",
                        "--speculative-model", str(out), "x"), "hidden_size 64", "96")
    bad = tmp_path / "bad.csv"
    bad.write_text("x\n")
    one_line_error(_cli("train-speculator", "--model", tiny_model, "--prompts", str(bad),
                        "--out", str(tmp_path / "o")), ".jsonl")
    one_line_error(_cli("train-speculator", "--model", tiny_model, "--prompts", str(prompts),
                        "--synthesize", "2", "--out", str(tmp_path / "o")),
                   "--synthesize", "chat template")
    one_line_error(_cli("train-speculator", "--model", tiny_model, "--synthesize", "-1",
                        "--out", str(tmp_path / "o")), "--synthesize")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    one_line_error(_cli("train-speculator", "--model", tiny_model, "--prompts", str(bad),
                        "--out", str(tmp_path / "o")), "bad.jsonl:1")


def test_config_needs_a_head():
    with pytest.raises(ConfigError, match="--speculative-model"):
        SpecConfig(method="eagle")
    assert SpecConfig(method="eagle", model="/x").enabled


def test_recorder_keeps_features_by_position():
    from feature_recorder import FeatureRecorder

    rec = FeatureRecorder()
    rows = torch.arange(12.0).reshape(6, 2)
    rec.observe(["a"], [0], [rows[:4]], [[0] * 6])
    rec.observe(["a"], [4], [rows[4:5]], [[0] * 6])
    rec.observe(["a"], [2], [rows[2:5] + 100], [[0] * 6])  # recomputed after a preemption
    f = rec.features("a", 6)
    assert f.shape == (5, 2) and f[1].tolist() == [2.0, 3.0] and f[3].tolist() == [106, 107]


def test_recording_with_async_scheduling(tiny_model):
    """A hidden-state proposer under async scheduling (the CUDA default): a request stopped by
    a stop token is seen one step late, after the next step, which still samples it, was
    launched; that step's output must not ask the proposer about the finished request. The
    features are those of the synchronous loop."""
    from feature_recorder import FeatureRecorder

    prompts = _prompts(12, seed=7)
    ref = LLM(tiny_model, device="cpu", dtype="float32").generate(prompts, GREEDY)
    params = [SamplingParams(temperature=0.0, max_tokens=24,
                             stop_token_ids=[o.outputs[0].token_ids[3]]) for o in ref]
    got = {}
    for mode in ("off", "on"):
        llm = LLM(tiny_model, device="cpu", dtype="float32", enable_prefix_caching=False,
                  async_scheduling=mode)
        rec = llm.engine.executor.runner.proposer = FeatureRecorder()
        outs = llm.generate(prompts, params)
        got[mode] = [(list(o.outputs[0].token_ids),
                      rec.features(o.request_id, len(p) + len(o.outputs[0].token_ids)))
                     for p, o in zip(prompts, outs, strict=True)]
    assert all(len(toks) <= 4 for toks, _ in got["on"])
    for (ta, fa), (tb, fb) in zip(got["off"], got["on"], strict=True):
        assert ta == tb
        # async also computed the stop token itself (in the step launched before it was seen)
        assert fb.shape[0] - fa.shape[0] in (0, 1)
        torch.testing.assert_close(fa, fb[: fa.shape[0]])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_lossless_and_trainable(tiny_model, random_head):
    """On CUDA the head drafts through the fused kernels (greedy output unchanged, CUDA graphs
    on) and trains through the torch references (autograd)."""
    prompts = _prompts(6, seed=11)
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_model, **kw).generate(prompts, GREEDY)]
    llm = LLM(tiny_model, speculative_method="eagle", speculative_model=random_head,
              num_speculative_tokens=4, **kw)
    llm.engine.executor.runner.proposer.min_confidence = 0.0
    spec = llm.engine.scheduler.spec
    spec.cfg = dataclasses.replace(spec.cfg, draft_cost=0.0)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0

    from skyline.tools.speculator.data import Example, record

    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2,
              enable_prefix_caching=False)
    samples = record(llm, [Example(p) for p in prompts], max_tokens=16)
    model = llm.engine.executor.runner.model
    head, stats = train_head(model, samples, TrainArgs(steps=5, batch_tokens=128,
                                                       draft_vocab=VOCAB))
    assert stats["last_loss"] < stats["first_loss"]
    assert head.fc.weight.dtype == torch.bfloat16 and head.fc.weight.is_cuda
