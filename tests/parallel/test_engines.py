"""Engines of several processes (gloo on the CPU) give one process's greedy tokens and seeded
samples: tensor parallel, pipeline parallel, both, and an uneven placement, with chunked
prefill, prefix hits and preemption in the same run; the step loop runs ahead (async
scheduling) across processes. Engines are expensive to start: each fixture's engine serves
every case of its layout."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny_hf import save_scaled

from skyline import LLM, SamplingParams
from skyline.ops import cpu_intdot, cpu_plan
from skyline.router.launch import free_port

transformers = pytest.importorskip("transformers")

VOCAB = 320
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
# Small blocks, a small pool (preemption) and a small token budget (chunked prefill).
SMALL = dict(device="cpu", dtype="float32", block_size=4, num_blocks=40, max_model_len=96,
             max_num_batched_tokens=16, max_num_seqs=8, async_scheduling="on",
             schedule_conservativeness=0)  # preemption by recompute


def _tiny(tmp_path_factory, kind: str) -> str:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, max_position_embeddings=256, eos_token_id=VOCAB - 1,
                  bos_token_id=1)
    if kind == "llama":  # one KV head: replicated on both tensor-parallel ranks
        cfg = transformers.LlamaConfig(**common, num_hidden_layers=3, num_key_value_heads=1,
                                       tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, num_hidden_layers=4, num_key_value_heads=2,
                                       head_dim=16, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    return save_scaled(model, tmp_path_factory.mktemp(kind))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _tiny(tmp_path_factory, "qwen3")


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def run_cases(llm: LLM) -> dict:
    """Every case one engine serves: a batch that chunks and preempts, prefix hits, seeded
    sampling; and that every block is back in the pool afterwards."""
    greedy = _tokens(llm.generate(_prompts(10, seed=1), GREEDY))
    shared = _prompts(1, seed=2, lo=24, hi=24)[0]
    pref = [shared + p for p in _prompts(4, seed=3, lo=2, hi=6)]
    first = _tokens(llm.generate(pref, GREEDY))
    again = llm.generate(pref, GREEDY)
    seeded = _tokens(llm.generate(_prompts(3, seed=4), SEEDED))
    stats = llm.engine.stats()
    pool = llm.engine.scheduler.kv_manager.block_pool
    assert pool.num_free_blocks == llm.engine.executor.num_blocks
    assert all(o.num_cached_tokens >= 24 for o in again)
    assert stats["num_preemptions"] > 0
    return {"greedy": greedy, "prefix": first, "again": _tokens(again), "seeded": seeded}


@pytest.fixture(scope="module")
def llama_ref(llama):
    """What one process gives (the reference of every layout)."""
    return run_cases(LLM(llama, **SMALL))


@pytest.fixture(scope="module")
def qwen3_ref(qwen3):
    return run_cases(LLM(qwen3, **SMALL))


def check_layout(path: str, want: dict, **parallel) -> LLM:
    llm = LLM(path, **SMALL, **parallel)
    try:
        assert run_cases(llm) == want
    except BaseException:
        llm.shutdown()
        raise
    return llm


def test_tensor_parallel(llama, llama_ref):
    llm = check_layout(llama, llama_ref, tensor_parallel_size=2)
    try:
        ids = _prompts(1, seed=5)[0]
        got = llm.engine.executor.query("score", ids)
        want = LLM(llama, **SMALL).engine.executor.query("score", ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        info = llm.engine.executor.describe()
        assert info["ranks"] == 2 and info["num_blocks"] == SMALL["num_blocks"]
    finally:
        llm.shutdown()


def test_tensor_and_pipeline_parallel(qwen3, qwen3_ref):
    check_layout(qwen3, qwen3_ref, tensor_parallel_size=2, pipeline_parallel_size=2).shutdown()


def test_uneven_placement(llama, llama_ref, monkeypatch):
    """Also: CPU ranks share the cores the engine's process leaves them, under the CLI's
    OpenMP wait policy (a user's wins)."""
    from skyline.envs import omp_defaults

    monkeypatch.setattr(os, "cpu_count", lambda: 7)  # (7 - 1 for the engine) // 2 ranks
    llm = check_layout(llama, llama_ref, placement="cpu=2,cpu=1")
    try:
        info = llm.engine.executor.describe()
        assert info["cpu_threads"] == 3
        want = omp_defaults(os.environ).get("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY"))
        assert info["omp_wait_policy"] == want
    finally:
        llm.shutdown()


def test_pipeline_stages_in_bfloat16(tmp_path):
    """Every stage gives a GGUF file's layers their serving layout in the engine's dtype, the
    stage without the LM head too (it once packed them in float32, and its first bfloat16
    activation stopped the engine)."""
    from skyline.bench.random_gguf import TINY_DENSE, write_dense_gguf

    path = str(tmp_path / "tiny.gguf")
    write_dense_gguf(path, TINY_DENSE)
    kw = {**SMALL, "dtype": "bfloat16", "quantization": "gguf"}
    # four prompts, and one alone: its decode steps' single rows take the bf16 kernel where the
    # CPU plan has one (ops/cpu_bf16.py), on weights in huge pages (ops/host_memory.py)
    prompts, one = _prompts(4, seed=6), _prompts(1, seed=7)
    single = LLM(path, **kw)
    try:
        want, want_one = (_tokens(single.generate(p, GREEDY)) for p in (prompts, one))
    finally:
        single.shutdown()
    llm = LLM(path, **kw, placement="cpu=3,cpu=1")
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == want
        assert _tokens(llm.generate(one, GREEDY)) == want_one
        # each CPU rank reports what its one-row steps run: its own Linears, the head on the last
        first, last = llm.query("describe")["cpu_kernels"]
        assert first["linears"] == {"gguf": 3 * 4} and last["linears"] == {"gguf": 4}
        assert first["lm_head"] is None
        if cpu_intdot.available() and cpu_plan.plan().intdot_rows:
            assert last["lm_head"] == "intdot8"
            assert first["decode_step"] == last["decode_step"] == "native"
    finally:
        llm.shutdown()


@pytest.mark.cuda
def test_gpu_and_cpu_stages(llama):
    """A stage on the GPU and one on the CPU, each running its own device's kernels, give the
    tokens of the whole model on the GPU (float32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gpu = {**SMALL, "device": "cuda"}
    want = run_cases(LLM(llama, **gpu))
    llm = LLM(llama, **{**SMALL, "device": "auto"}, placement="cuda:0=2,cpu=1")
    try:
        got = run_cases(llm)
        # seeded draws come from the generator of the device that samples (the last stage's,
        # the CPU here), so they equal the GPU's only in distribution, not draw for draw
        assert {k: v for k, v in got.items() if k != "seeded"} == {
            k: v for k, v in want.items() if k != "seeded"}
        assert len(got["seeded"]) == len(want["seeded"])
    finally:
        llm.shutdown()


def test_default_model_tensor_parallel():
    """SmolLM2's 9 query heads in 3 groups split 6 + 3 over two ranks."""
    kw = dict(device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    want = _tokens(LLM(**kw).generate(prompts, params))
    llm = LLM(**kw, tensor_parallel_size=2)
    try:
        assert _tokens(llm.generate(prompts, params)) == want
    finally:
        llm.shutdown()


def test_a_dying_rank_stops_the_engine_with_one_error(llama):
    from skyline.worker.executor.multiproc import RankError

    holder: list[LLM] = []
    steps = []

    def kill_after_three_steps(out, scheduled_at, seconds):
        steps.append(1)
        if len(steps) == 3:
            os.kill(holder[0].engine.executor.procs[1].pid, signal.SIGKILL)

    llm = LLM(llama, **SMALL, pipeline_parallel_size=2, observers=[kill_after_three_steps])
    holder.append(llm)
    t = time.monotonic()
    with pytest.raises(RankError, match=r"^rank 1 \(pid \d+\) was killed by SIGKILL; the engine "
                                        r"stopped$"):
        llm.generate(_prompts(6, seed=6), GREEDY)
    assert time.monotonic() - t < 30
    procs = llm.engine.executor.procs.values()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RankError):  # the same error at every later call
        llm.generate(_prompts(1, seed=7), GREEDY)
    llm.shutdown()


def test_a_rank_that_raises_or_cannot_start(llama, llama_ref):
    from skyline.config import ConfigError
    from skyline.worker.executor.multiproc import RankError

    # a split the weight format cannot make fails in the ranks, before any step
    with pytest.raises(ConfigError, match="int4 layer in groups of 64 cannot be split"):
        LLM(llama, **SMALL, tensor_parallel_size=2, quantization="int4", quant_group_size=64)
    llm = LLM(llama, **SMALL, distributed_executor="mp")  # one rank, in a process of its own
    try:
        assert _tokens(llm.generate(_prompts(10, seed=1), GREEDY)) == llama_ref["greedy"]
        with pytest.raises(RankError, match="rank 0 failed: KeyError: 'no such query'"):
            llm.engine.executor.query("no such query")
    finally:
        llm.shutdown()


def test_ranks_of_another_host_join_through_the_store(llama, llama_ref):
    init = f"tcp://127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, "-m", "skyline.cli", "worker", "--distributed-init",
                               init, "--node-rank", "1", "--nnodes", "2"])
    try:
        llm = LLM(llama, **SMALL, tensor_parallel_size=2, nnodes=2, distributed_init=init,
                  distributed_timeout=120)  # a worker that never joins fails the test
        try:
            assert _tokens(llm.generate(_prompts(10, seed=1), GREEDY)) == llama_ref["greedy"]
        finally:
            llm.shutdown()
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
