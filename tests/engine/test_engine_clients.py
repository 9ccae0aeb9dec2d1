"""The engine core's loop with several API processes (engine/process.py): each request's
outputs, add errors and call results reach only the process that sent it, with its own
`num_adds`; ("hello", i) drops what a predecessor at index i left running. A fake core and real
ZMQ sockets, no model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from skyline.engine.codec import pack, request_to_dict, step_output_from_list, unpack
from skyline.engine.loop import EngineLoop, QueueTimes
from skyline.types import Request, SamplingParams, StepOutput


class _FakeCore:
    max_model_len = 64

    def __init__(self) -> None:
        self.running: set[str] = set()
        pool = SimpleNamespace(num_blocks=10, num_free_blocks=10)
        self.scheduler = SimpleNamespace(kv_manager=SimpleNamespace(block_pool=pool))
        self.config = SimpleNamespace(model=SimpleNamespace(arch=SimpleNamespace(vocab_size=100)))

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.running), "num_waiting": 0}

    def add_request(self, req: Request) -> None:
        if req.prompt_token_ids == [99]:
            raise ValueError("no such prompt")
        self.running.add(req.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        self.running -= set(ids)


def _add(rid: str, prompt: list[int], client: int) -> tuple[Any, ...]:
    return ("add", request_to_dict(Request(rid, prompt, SamplingParams(max_tokens=4))), client)


def _recv(sock: zmq.Socket) -> Any:
    assert sock.poll(5000), "nothing arrived"
    return unpack(sock.recv())


@pytest.fixture
def two_clients(tmp_path):
    ctx = zmq.Context()
    outs = []
    for i in range(2):
        s = ctx.socket(zmq.PULL)
        s.bind(f"ipc://{tmp_path}/out-{i}")
        outs.append(s)
    inp = ctx.socket(zmq.PUSH)
    inp.bind(f"ipc://{tmp_path}/in")
    core = _FakeCore()
    loop = EngineLoop(core, QueueTimes(), [f"ipc://{tmp_path}/in"],
                       [f"ipc://{tmp_path}/out-{i}" for i in range(2)])
    yield loop, core, outs, inp
    loop.close()
    for s in [*outs, inp]:
        s.close(linger=0)
    ctx.term()


def test_outputs_go_to_the_process_that_sent_the_request(two_clients):
    loop, core, outs, inp = two_clients
    loop.handle(list(_add("a0:r", [1, 2], 0)))
    loop.handle(list(_add("a1:r", [1, 2], 1)))
    loop.handle(list(_add("a1:s", [3], 1)))
    loop.handle(list(_add("a1:bad", [99], 1)))
    assert _recv(outs[1]) == ["add_error", "a1:bad", "no such prompt"]
    loop.send_outputs([StepOutput("a0:r", [5]), StepOutput("a1:r", [6], finish_reason="length"),
                       StepOutput("a1:s", [7])], loop.stats())
    got = [_recv(s) for s in outs]
    assert [[step_output_from_list(v).request_id for v in m[1]] for m in got] == [
        ["a0:r"], ["a1:r", "a1:s"]]
    assert got[0][2]["num_adds"] == 1 and got[1][2]["num_adds"] == 3
    assert "a1:r" not in loop.owners  # finished: forgotten
    loop.handle(["call", 7, "stats", [], 1])
    result = _recv(outs[1])
    assert result[:2] == ["result", 7] and result[2]["num_adds"] == 3
    assert not outs[0].poll(100)  # nothing for process 0 but its own outputs
    # A new process 1 says hello: what process 1 left running is aborted, process 0's is not.
    loop.handle(["hello", 1])
    assert "a1:s" not in core.running and "a0:r" in core.running
    assert set(loop.owners) == {"a0:r"} and loop.num_adds == [1, 0]
    # An abort from any process, through the socket
    inp.send(pack(("abort", ["a0:r"])))
    loop.drain(block=True)
    assert "a0:r" not in core.running and loop.owners == {}


def test_each_process_prefixes_the_ids_it_sends_the_core() -> None:
    from skyline.engine.frontend.output import OutputProcessor

    # the same client request id in two API processes: two engine requests
    a, b = OutputProcessor(None, "a0:"), OutputProcessor(None, "a1:")
    params = SamplingParams(max_tokens=2, n=2)
    assert a.add_request("cmpl-1", None, [1], params) == ["a0:cmpl-1#0", "a0:cmpl-1#1"]
    assert b.add_request("cmpl-1", None, [1], params) == ["a1:cmpl-1#0", "a1:cmpl-1#1"]
    out, _ = b.process([StepOutput("a1:cmpl-1#1", [5], finish_reason="length")])
    assert out[0].request_id == "cmpl-1" and out[0].outputs[1].token_ids == [5]
    assert OutputProcessor(None).add_request("r", None, [1], SamplingParams()) == ["r"]


def test_a_request_done_in_its_first_step_reports_its_queue_time_to_its_process(two_clients):
    """The queue time of a request scheduled and finished in one step (max_tokens=1, or an
    abort by a stop string) went to process 0: its owner was forgotten before it was looked
    up, so process 1's queue-time metric missed every such request."""
    loop, core, outs, inp = two_clients
    loop.handle(list(_add("a1:q", [1, 2], 1)))
    loop.queue_times.seconds["a1:q"] = 0.25  # scheduled in this step
    loop.send_outputs([StepOutput("a1:q", [5], finish_reason="length")], loop.stats())
    got = [_recv(s) for s in outs]
    assert got[1][3] == {"a1:q": 0.25} and got[0][3] == {}
    assert loop.owners == {}


def test_a_replaced_api_process_does_not_take_its_predecessors_call_results(tmp_path):
    """The core queues what it sends a killed API process and delivers it to the process
    started at the same index (zmq keeps the connecting side's pipe): a call result meant for
    the predecessor answered the successor's call of the same id (both counted from 0)."""
    import asyncio

    from skyline.engine.frontend.async_llm import AsyncLLM

    info = {"model_name": "m", "model_path": str(tmp_path), "load_format": "dummy",
            "max_model_len": 64, "vocab_size": 100, "eos_token_ids": [1], "max_num_seqs": 4}

    class Link:
        def __init__(self, **callbacks: Any) -> None:
            self.info, self.dead, self.num_restarts, self.sent = info, None, 0, []

        def start(self) -> None:
            pass

        def send(self, msg: Any) -> None:
            self.sent.append(msg)

        def shutdown(self, timeout: float = 0.0) -> None:
            pass

    async def main() -> None:
        old, new = (AsyncLLM(None, link=Link, id_prefix="a1:") for _ in range(2))
        stale = asyncio.ensure_future(old.call("stats"))
        mine = asyncio.ensure_future(new.call("stats"))
        await asyncio.sleep(0)
        new._handle(["result", old.engine.sent[-1][1], {"from": "old"}])
        await asyncio.sleep(0)
        assert not mine.done()
        new._handle(["result", new.engine.sent[-1][1], {"from": "new"}])
        assert await mine == {"from": "new"}
        stale.cancel()

    asyncio.run(main())
