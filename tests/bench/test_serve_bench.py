"""`bench serve` against a real skyline server (default model, CPU, tiny lengths)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from skyline.bench.frontier import start_server, stop_server
from skyline.bench.serve import LoadSpec, run_serve_bench
from skyline.bench.workloads import WorkloadSpec
from skyline.cli import main


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, url = start_server(["--kv-cache-memory", "128MiB"], str(log), 180.0)
    yield url
    stop_server(proc)


def test_random_completions_token_exact(base_url: str, tmp_path, capsys) -> None:
    out = tmp_path / "res.json"
    main(["bench", "serve", "--base-url", base_url, "--num-requests", "3", "--concurrency",
          "2", "--input-len", "16", "--output-len", "4", "--goodput", "ttft:60000",
          "--output", str(out), "--no-progress"])
    assert "Output token throughput" in capsys.readouterr().out
    res = json.loads(out.read_text())
    s = res["summary"]
    assert res["token_exact_prompts"] is True
    assert (s["completed"], s["failed"]) == (3, 0)
    assert [r["input_len"] for r in res["requests"]] == [16, 16, 16]
    assert [r["output_len"] for r in res["requests"]] == [4, 4, 4]
    assert all(0 < r["ttft"] <= r["e2e"] for r in res["requests"])
    assert s["output_throughput"] > 0 and s["tpot_ms"]["p99"] > 0
    assert s["goodput"]["good_requests"] == 3


def test_multi_turn_chat_with_rate(base_url: str) -> None:
    # Poisson arrivals capped at one conversation in flight: turn 2 of the first, then the next.
    load = LoadSpec(base_url=base_url, endpoint="chat", request_rate=50.0, concurrency=1,
                    num_requests=3, progress=False, warmup=0)
    res = run_serve_bench(load, WorkloadSpec("multi-turn", "8", "2", num_turns=2), {},
                          print_table=False)
    assert res["summary"]["completed"] == 3
    assert all(r["output_len"] == 2 for r in res["requests"])
    # The second turn resends the first turn and its answer: a longer prompt.
    lens = sorted(r["input_len"] for r in res["requests"])
    assert lens[-1] > lens[0]


def test_unreachable_server_is_one_sentence() -> None:
    load = LoadSpec(base_url="http://127.0.0.1:9/v1", num_requests=1, progress=False)
    with pytest.raises(ValueError, match="cannot reach"):
        run_serve_bench(load, WorkloadSpec(), {}, print_table=False)


def test_sampling_parameters_reach_the_request_body() -> None:
    from skyline.bench.serve.client import _Client
    from skyline.bench.workloads import Conversation, Turn

    conv = Conversation([Turn([1, 2, 3], 4, 3)])
    _, body = _Client(LoadSpec(model="m", temperature=0.8, top_p=0.9), None).body(conv, 0, [])
    assert (body["temperature"], body["top_p"], body["prompt"]) == (0.8, 0.9, [1, 2, 3])
    _, body = _Client(LoadSpec(model="m"), None).body(conv, 0, [])
    assert body["temperature"] == 0.0 and "top_p" not in body
