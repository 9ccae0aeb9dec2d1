"""Metric math, goodput, workloads, grid parsing and the Pareto front on synthetic data."""

from __future__ import annotations

import math

import pytest

from skyline.bench.frontier import concurrencies, grid_settings, parse_grid
from skyline.bench.metrics import (
    RequestResult,
    format_table,
    parse_goodput,
    percentile,
    split_first,
    stats_ms,
    summarize,
)
from skyline.bench.report import pareto_front
from skyline.bench.serve.load import LoadSpec, split_load
from skyline.bench.workloads import WorkloadSpec, make_conversations, parse_len


def test_percentile_matches_linear_interpolation() -> None:
    xs = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    s = stats_ms([0.1, 0.2, 0.3])
    assert s["mean"] == pytest.approx(200.0) and s["median"] == pytest.approx(200.0)


def _req(ttft: float, e2e: float, out: int, ok: bool = True) -> RequestResult:
    gaps = [(e2e - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    return RequestResult(input_len=10, output_len=out, ttft=ttft, e2e=e2e, itl=gaps, success=ok)


def test_summary_throughput_tpot_and_goodput() -> None:
    reqs = [_req(0.1, 1.0, 10), _req(0.5, 2.3, 10), _req(0.2, 0.2, 1), _req(0, 0, 0, ok=False)]
    slos = parse_goodput(["ttft:300", "tpot:150"])
    assert slos == {"ttft": 300.0, "tpot": 150.0}
    s = summarize(reqs, duration_s=2.0, slos=slos)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_output_tokens"] == 21 and s["output_throughput"] == pytest.approx(10.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    # TPOT: (1.0 - 0.1) / 9 = 100 ms and (2.3 - 0.5) / 9 = 200 ms; one-token outputs have none.
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["itl_ms"]["median"] == pytest.approx(150.0)
    # Good: the first (ttft 100, tpot 100) and the one-token one (ttft 200); not the failure.
    assert s["goodput"]["good_requests"] == 2
    assert s["goodput"]["request_goodput"] == pytest.approx(1.0)
    assert "Request goodput" in format_table(s)
    for bad in (["ttft"], ["speed:5"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_workloads_lengths_and_errors() -> None:
    convs = make_conversations(WorkloadSpec("random", "8:12", "5"), 20)
    assert all(8 <= c.turns[0].input_len <= 12 and c.turns[0].max_tokens == 5 for c in convs)
    assert convs[0].turns[0].prompt == make_conversations(WorkloadSpec("random", "8:12"), 1)[
        0].turns[0].prompt  # deterministic
    mt = make_conversations(WorkloadSpec("multi-turn", "8", "4", num_turns=3), 2)
    assert len(mt[0].turns) == 3
    sp = make_conversations(WorkloadSpec("shared-prefix", "8", system_prompt_len=50), 3)
    assert sp[0].system == sp[2].system and sp[0].turns[0].prompt != sp[1].turns[0].prompt
    code = make_conversations(WorkloadSpec("code-edit", "120", "100"), 1)[0]
    assert "def " in code.turns[0].prompt
    with pytest.raises(ValueError, match="--input-len"):
        parse_len("9:3", "--input-len")
    with pytest.raises(ValueError, match="at most"):
        make_conversations(WorkloadSpec("long-context", "300000"), 1)
    with pytest.raises(ValueError, match="--dataset"):
        make_conversations(WorkloadSpec("file"), 1)


def test_file_workload(tmp_path) -> None:
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n'
                 '{"messages": [{"role": "user", "content": "hi"}]}\n')
    convs = make_conversations(WorkloadSpec("file", output_len="7", path=str(p)), 3)
    assert [c.turns[0].max_tokens for c in convs] == [3, 7, 3]
    assert convs[1].messages == [{"role": "user", "content": "hi"}]


def test_grid_and_pareto() -> None:
    grid = parse_grid(["max_num_seqs=4,16", "no-prefix-caching=true,false"])
    assert grid == [("--max-num-seqs", ["4", "16"]), ("--no-prefix-caching", ["true", "false"])]
    assert grid_settings(grid) == [["--max-num-seqs", "4", "--no-prefix-caching"],
                                   ["--max-num-seqs", "4"],
                                   ["--max-num-seqs", "16", "--no-prefix-caching"],
                                   ["--max-num-seqs", "16"]]
    assert concurrencies("1, 8,32") == [1, 8, 32]
    with pytest.raises(ValueError):
        parse_grid(["max_num_seqs"])
    with pytest.raises(ValueError):
        concurrencies("0")
    row = lambda t, u, kl: {"throughput_per_gpu": t, "user_tok_s": u, "kl": kl}
    rows = [row(100, 10, 0.0), row(50, 20, 0.0), row(40, 5, 0.0), row(120, 9, 0.1),
            row(100, 10, 0.0)]
    # (40, 5) is dominated; (120, 9) trades quality for speed; equal points both stay.
    assert pareto_front(rows) == [True, True, False, True, True]


def test_the_first_wave_is_the_requests_that_started_first() -> None:
    rs = [RequestResult(input_len=1, start=s, ttft=t) for s, t in
          [(0.3, 0.05), (0.0, 0.9), (0.001, 0.8), (2.0, 0.04), (0.0002, 0.7)]]
    first, rest = split_first(rs, 3)
    assert [r.ttft for r in first] == [0.9, 0.7, 0.8]
    assert [r.start for r in rest] == [0.3, 2.0]
    assert split_first(rs, 9) == (sorted(rs, key=lambda r: r.start), [])


def test_client_processes_share_the_users_requests_and_rate() -> None:
    load = LoadSpec(concurrency=10, num_requests=23, request_rate=40.0, seed=5)
    jobs = split_load(load, WorkloadSpec(seed=1), 4)
    assert [j.concurrency for j, _ in jobs] == [3, 3, 2, 2]
    assert [j.num_requests for j, _ in jobs] == [6, 6, 6, 5]
    assert [j.request_rate for j, _ in jobs] == pytest.approx([12.0, 12.0, 8.0, 8.0])
    assert [j.seed for j, _ in jobs] == [5, 6, 7, 8] and [w.seed for _, w in jobs] == [1, 2, 3, 4]
    # a closed loop stays one: no rate appears; never more processes than users
    jobs = split_load(LoadSpec(concurrency=2, num_requests=4), WorkloadSpec(), 8)
    assert len(jobs) == 2 and all(j.request_rate is None for j, _ in jobs)
