"""The same engine on a CUDA GPU: greedy tokens equal the CPU engine's (fp32), and bf16 runs
end to end with the memory-profiled KV cache. Skipped without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from skyline import LLM, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama):
    return tiny_llama(0.15, "tiny", hidden_size=128, intermediate_size=256,
                      max_position_embeddings=1024, eos_token_id=2)


def test_cuda_matches_cpu_fp32(tiny_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 319) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = LLM(tiny_dir, device="cpu", dtype="float32").generate(prompts, params)
    gpu = LLM(tiny_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
              max_num_batched_tokens=37).generate(prompts, params)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(cpu, gpu, strict=True))
    # fp32 on different hardware can flip a near-tie; nearly all must agree exactly
    assert same >= len(prompts) - 1


def test_cuda_bf16_profiled_cache(tiny_dir):
    llm = LLM(tiny_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2)
    assert llm.engine.executor.num_blocks > 1000
    outs = llm.generate([[5, 6, 7]] * 8, SamplingParams(temperature=0.8, max_tokens=32,
                                                        ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)


def test_cuda_graphs_match_eager(tiny_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 319) for _ in range(rng.randint(3, 40))] for _ in range(19)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = LLM(tiny_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                enforce_eager=True).generate(prompts, params)
    llm = LLM(tiny_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    assert llm.engine.executor.runner.graphs is not None
    graphs = llm.generate(prompts, params)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(eager, graphs, strict=True))
    assert same >= len(prompts) - 1


def test_cuda_async_scheduling_matches_sync(tiny_dir):
    """On a GPU the next step is launched before this step's tokens are read; what clients see
    is unchanged: greedy and seeded tokens, penalties, stops, logprobs, bf16 with CUDA graphs."""
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 319) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=15, seed=5, ignore_eos=True,
                       repetition_penalty=1.2, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[7, 11, 13]),
    ]
    reqs = [(p, params[i % len(params)]) for i, p in enumerate(prompts)]

    def run(mode: str):
        llm = LLM(tiny_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2,
                  async_scheduling=mode)
        outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        assert llm.engine.scheduler.kv_manager.block_pool.num_free_blocks == \
            llm.engine.executor.num_blocks
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                 [lp.token_ids for lp in o.outputs[0].logprobs or []]) for o in outs]

    assert run("on") == run("off")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_cuda_graphs_for_verification_steps(tiny_dir, method, monkeypatch):
    """Verification steps (each request's last token and its drafts) replay the extend graphs;
    greedy tokens equal plain eager decoding (fp32) and every KV block comes back."""
    from skyline.worker.cuda_graph import GraphShape

    rng = random.Random(3)
    base = [[rng.randrange(2, 319) for _ in range(rng.randint(3, 8))] for _ in range(11)]
    prompts = [b * 4 for b in base]  # repeated spans: prompt lookup has drafts to propose
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = LLM(tiny_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                enforce_eager=True).generate(prompts, params)
    extra = {"speculative_draft_layers": 1} if method == "draft" else {}
    llm = LLM(tiny_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
              speculative_method=method, speculative_gate=False, **extra)
    graphs = llm.engine.executor.runner.graphs
    assert graphs is not None and GraphShape(1, 6, 6) in graphs.graphs
    used = []
    replay = graphs.run

    def run(inp, shape):
        used.append((shape, len(inp.req_ids), inp.input_ids.shape[0]))
        return replay(inp, shape)

    monkeypatch.setattr(graphs, "run", run)
    spec = llm.generate(prompts, params)
    # padded steps: fewer sequences or tokens than the graph's shape
    assert any(s.query_len > 1 for s, _, _ in used)
    assert any(s.num_tokens > t and s.query_len > 1 for s, _, t in used)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(plain, spec, strict=True))
    assert same >= len(prompts) - 1
    assert llm.engine.scheduler.kv_manager.block_pool.num_free_blocks == \
        llm.engine.executor.num_blocks


def test_cuda_mixed_step_graphs_match_eager(tiny_dir, monkeypatch):
    """Requests arriving while others decode: most steps mix a prompt chunk with the decodes
    and replay a mixed-step graph; greedy tokens equal the eager engine's (fp32)."""
    from skyline.worker.cuda_graph import CudaGraphRunner

    rng = random.Random(3)
    prompts = [[rng.randrange(2, 319) for _ in range(rng.randint(5, 90))] for _ in range(14)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    replayed = []  # the shapes the graphs replay
    real_run = CudaGraphRunner.run

    def run_and_record(self, inp, shape):
        replayed.append(shape)
        return real_run(self, inp, shape)

    monkeypatch.setattr(CudaGraphRunner, "run", run_and_record)

    def run(**kw):
        llm = LLM(tiny_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                  max_num_batched_tokens=64, **kw)
        done, pending = {}, list(enumerate(prompts))
        while pending or llm.engine.has_unfinished():
            for _ in range(2):  # two arrivals every three steps
                if pending:
                    i, p = pending.pop(0)
                    llm.add_request(p, params, request_id=str(i))
            for _ in range(3):
                for o in llm.step():
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
        return [done[str(i)] for i in range(len(prompts))], llm

    eager, _ = run(enforce_eager=True)
    assert not replayed
    graphs, llm = run()
    assert llm.engine.executor.runner.graphs.num_mixed > 0
    assert sum(s.mixed for s in replayed) >= 10
    same = sum(a == b for a, b in zip(eager, graphs, strict=True))
    assert same >= len(prompts) - 1


def test_no_step_compiles_a_kernel_after_start_up(tiny_dir):
    # Start-up compiles every bucket's variant (CUDA graphs' warm-ups, then
    # worker/runner/warm.py for eager steps): prompts of every length, alone and beside
    # decodes of every batch size, compile nothing more (a compilation holds its step's
    # requests for up to seconds).
    # a step holds more tokens than a sequence: several prompts make its largest steps
    llm = LLM(tiny_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              max_num_batched_tokens=1024, max_num_seqs=64, max_model_len=512)
    assert llm.query("step_clocks")["compiles"] == 0
    rng = random.Random(3)
    lengths = [1, 2, 3, 5, 15, 17, 63, 65, 255, 257, 400, 490]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch in (1, 3, 7, 20, 63):
        prompts = [[rng.randrange(2, 319) for _ in range(rng.choice(lengths))]
                   for _ in range(batch)]
        llm.generate(prompts, params)
    clocks = llm.query("step_clocks")
    assert clocks["compiles"] == 0, clocks["kernels"]
