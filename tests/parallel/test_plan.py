"""Placement, shard arithmetic, micro-batch splits and the step wire format: no processes."""

from __future__ import annotations

import pytest

from skyline.config import ConfigError
from skyline.parallel.placement import (
    DeviceBudget,
    Stage,
    even_stages,
    format_stages,
    parse_placement,
    plan_stages,
)
from skyline.parallel.shard import HeadShard, head_shard, padded_shard
from skyline.types import (
    CachedRequestData,
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)
from skyline.worker.executor.codec import StepEncoder, decode_output, decode_step, encode_output
from skyline.worker.step import split_parts

GiB = 2**30


def test_parse_and_even_placement():
    assert parse_placement("cpu=2,cpu=1", 3) == [Stage("cpu", 0, 2), Stage("cpu", 2, 3)]
    stages = parse_placement("cuda:0=28, cuda:1=20,cpu=8", 56)
    assert [(s.device, s.num_layers) for s in stages] == [("cuda:0", 28), ("cuda:1", 20),
                                                          ("cpu", 8)]
    assert format_stages(stages) == "cuda:0=28,cuda:1=20,cpu=8"
    assert [s.num_layers for s in even_stages(5, ["cpu"] * 2)] == [3, 2]
    for bad, match in [("cpu=2,cpu=2", "add up to 3"), ("tpu=3", "cpu or cuda:N"),
                       ("cpu=0,cpu=3", "DEVICE=LAYERS"), ("cuda=3", "cpu or cuda:N")]:
        with pytest.raises(ConfigError, match=match):
            parse_placement(bad, 3)
    with pytest.raises(ConfigError, match="fewer than the 4 pipeline stages"):
        even_stages(3, ["cpu"] * 4)


def test_plan_shares_layers_by_speed_within_memory():
    # a GPU twice as fast as the other takes twice the layers
    fast, slow = DeviceBudget("cuda:0", 80 * GiB, 1e-3), DeviceBudget("cuda:1", 80 * GiB, 2e-3)
    cpu = DeviceBudget("cpu", 500 * GiB, 30e-3)
    stages = plan_stages(30, [slow, fast, cpu], GiB)
    assert [(s.device, s.num_layers) for s in stages] == [("cuda:0", 20), ("cuda:1", 10)]
    # the GPUs hold 20 + 10 layers: the CPU takes the rest, as the first stage
    small = [DeviceBudget("cuda:0", 20 * GiB, 1e-3), DeviceBudget("cuda:1", 10 * GiB, 1e-3),
             cpu]
    stages = plan_stages(40, small, GiB)
    assert [(s.device, s.num_layers) for s in stages] == [("cpu", 10), ("cuda:0", 20),
                                                          ("cuda:1", 10)]
    assert [s.start for s in stages] == [0, 10, 30]
    # the embedding and head count on the stages that hold them
    stages = plan_stages(40, small, GiB, first_bytes=GiB, last_bytes=2 * GiB)
    assert sum(s.num_layers for s in stages) == 40 and stages[0].device == "cpu"
    assert [s.num_layers for s in stages[1:]] == [19, 8]
    assert plan_stages(4, [cpu], GiB) == [Stage("cpu", 0, 4)]
    with pytest.raises(ConfigError, match="need about"):
        plan_stages(40, small[:2] + [DeviceBudget("cpu", 5 * GiB, 1.0)], GiB)


def test_head_shards():
    # 9 query heads in 3 groups over 2 ranks: whole groups, as even as can be
    assert head_shard(9, 3, 2, 0) == HeadShard(0, 6, 0, 2)
    assert head_shard(9, 3, 2, 1) == HeadShard(6, 3, 2, 1)
    # fewer KV heads than ranks: each KV head on several ranks, its query heads split
    assert [head_shard(4, 1, 2, r) for r in range(2)] == [HeadShard(0, 2, 0, 1),
                                                          HeadShard(2, 2, 0, 1)]
    assert [head_shard(8, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert [head_shard(8, 2, 4, r).q_start for r in range(4)] == [0, 2, 4, 6]
    with pytest.raises(ConfigError, match="cannot be split"):
        head_shard(4, 2, 3, 0)
    assert padded_shard(10, 4, 3) == (9, 1, 3)


def test_split_parts_balances_tokens_in_batch_order():
    sched = {"p": 9, "a": 1, "b": 1, "q": 3, "c": 1}
    parts = split_parts(sched, 2)
    assert [list(p) for p in parts] == [["a", "b", "c", "p"], ["q"]]
    assert split_parts(sched, 1) == [sched]
    parts = split_parts({"a": 1, "b": 1, "c": 1}, 4)
    assert [list(p) for p in parts] == [["a"], ["b"], ["c"]]
    many = {str(i): 1 for i in range(10)}
    assert [len(p) for p in split_parts(many, 3)] == [4, 3, 3]


def test_step_messages_round_trip_and_leave_out_what_ranks_know():
    enc = StepEncoder()
    params = SamplingParams(temperature=0.5, stop=["x"], seed=3, json_schema={"type": "object"})
    first = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], [], params, [0], 0),
                      NewRequestData("b", [4, 5], [7], SamplingParams(), [1, 2], 1)],
        num_scheduled_tokens={"a": 3, "b": 2}, total_num_scheduled_tokens=5,
        token_masks={"a": b"\x01\x00\x00\x00"})
    got = decode_step(enc.encode(first))
    assert got == first
    # decode: a's count is what the ranks hold (3): left out; b got a block: sent
    second = SchedulerOutput(
        cached_requests=[CachedRequestData("a", [], 3), CachedRequestData("b", [5], 3)],
        num_scheduled_tokens={"b": 1, "a": 1}, total_num_scheduled_tokens=2,
        spec_token_ids={"b": [9]}, propose_drafts=False)
    got = decode_step(enc.encode(second))
    assert got.cached_requests == [CachedRequestData("b", [5], 3)]
    assert list(got.num_scheduled_tokens.items()) == [("b", 1), ("a", 1)]
    assert got.spec_token_ids == {"b": [9]} and not got.propose_drafts
    # a count the ranks could not know (drafts rejected) is sent; finished requests forgotten
    third = SchedulerOutput(cached_requests=[CachedRequestData("a", [], 3),
                                             CachedRequestData("b", [], 4, 1)],
                            num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                            finished_request_ids={"c"})
    got = decode_step(enc.encode(third))
    assert got.cached_requests == third.cached_requests and got.finished_request_ids == {"c"}
    out = RunnerOutput(["a", "b"], [[5], []], [[TokenLogprobs([5, 1], [-0.1, -2.0], 1)], None],
                       [[1, 2], []])
    assert decode_output(encode_output(out)) == out
    plain = RunnerOutput(["a"], [[5]], [None], [])
    assert decode_output(encode_output(plain)) == plain


def test_parallel_settings_are_checked_before_any_process_starts(tmp_path):
    import json

    from skyline.engine.args import EngineArgs
    from skyline.engine.create import create_engine_config

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
           "vocab_size": 128, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def config(**kw):
        return create_engine_config(EngineArgs(model=str(tmp_path), load_format="dummy",
                                               device="cpu", **kw))[0]

    pc = config(tensor_parallel_size=2, pipeline_parallel_size=3).parallel
    assert pc.world_size == 6 and pc.executor == "mp"
    assert pc.stages == (("cpu", 0, 1), ("cpu", 1, 2), ("cpu", 2, 3))
    assert config(placement="cpu=1,cpu=2").parallel.stages == (("cpu", 0, 1), ("cpu", 1, 3))
    auto = config(placement="auto").parallel  # one CPU: one stage, in this process
    assert auto.stages == (("cpu", 0, 3),) and auto.executor == "uni"
    for kw, match in [
        (dict(tensor_parallel_size=4), "6 attention heads with 2 KV heads cannot be split"),
        (dict(tensor_parallel_size=3, pipeline_parallel_size=1), "KV heads cannot be split"),
        (dict(pipeline_parallel_size=4), "fewer than the 4 pipeline stages"),
        (dict(placement="cpu=2,cpu=2"), "add up to 3"),
        (dict(placement="cpu=1,cpu=2", tensor_parallel_size=2), "drop --tensor-parallel"),
        (dict(tensor_parallel_size=2, speculative_method="ngram"), "speculative decoding"),
        (dict(tensor_parallel_size=2, distributed_executor="uni"), "need a process each"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config(**kw)
    cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"] = 4, 4, 90
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"intermediate size \(90\) is not divisible"):
        config(tensor_parallel_size=4)
    # a MoE model: 3 experts of 30 intermediate features
    cfg.update(architectures=["Qwen3MoeForCausalLM"], num_experts=3, num_experts_per_tok=2,
               moe_intermediate_size=30, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    pc = config(tensor_parallel_size=2, expert_parallel=True).parallel
    assert pc.expert_parallel and not config(tensor_parallel_size=2).parallel.expert_parallel
    assert config(n_cpu_moe=99).parallel.n_cpu_moe == 3  # at most every layer
    for kw, match in [
        (dict(tensor_parallel_size=4, expert_parallel=True), "3 experts cannot be shared"),
        (dict(tensor_parallel_size=4), r"experts' intermediate size \(30\) is not divisible"),
        (dict(tensor_parallel_size=2, n_cpu_moe=1), "--n-cpu-moe runs with one rank per"),
        (dict(expert_parallel=True), "--tensor-parallel-size is 1; set it to 2 or more"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config(**kw)
    from skyline.worker.executor.spawn import parse_init

    assert parse_init("tcp://10.0.0.1:29500") == ("10.0.0.1", 29500)
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        parse_init("http://x:1")


def test_cpu_ranks_leave_a_core_to_each_gpu_rank_and_the_engine():
    from skyline.worker.executor.spawn import cpu_rank_threads

    assert cpu_rank_threads(16, cpu_ranks=1, gpu_ranks=1, engine_here=True) == 14
    assert cpu_rank_threads(16, cpu_ranks=2, gpu_ranks=0, engine_here=True) == 7
    assert cpu_rank_threads(16, cpu_ranks=1, gpu_ranks=0, engine_here=False) == 16  # a worker host
    assert cpu_rank_threads(2, cpu_ranks=2, gpu_ranks=0, engine_here=True) == 1  # never none
    assert cpu_rank_threads(8, cpu_ranks=0, gpu_ranks=8, engine_here=True) == 1
