"""The pieces the engine core's supervisor shares with the parent of several API processes
(engine/supervisor.py): the restart window's count and backoff, and the loop that reads one
engine generation's outputs. No engine process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio

from skyline.engine import supervisor
from skyline.engine.codec import pack
from skyline.engine.supervisor import (
    EngineDeadError,
    RestartPolicy,
    RestartWindow,
    exit_description,
    read_engine,
    send_nowait,
)


def test_restart_window_backs_off_then_gives_up_and_forgets_old_failures(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    window = RestartWindow(RestartPolicy(max_restarts=3, window_s=60.0, backoff_first_s=0.5,
                                         backoff_max_s=1.5))
    assert [window.failed() for _ in range(4)] == [0.5, 1.0, 1.5, None]
    assert len(window) == 4
    now[0] += 61.0  # all four fall out of the window: the count starts again
    assert window.failed() == 0.5 and len(window) == 1


def test_restart_window_of_no_restarts_gives_up_at_once():
    assert RestartWindow(RestartPolicy(max_restarts=0)).failed() is None


def test_exit_description():
    assert exit_description(-9) == "killed by signal 9"
    assert exit_description(1) == "exit code 1"
    assert exit_description(None) == "exit code None"


def _read(tmp_path, msgs: list[Any], on_message) -> list[str]:
    """Run read_engine over `msgs` sent on a real socket; the reasons it failed with."""
    addr = f"ipc://{tmp_path}/out"
    failures: list[str] = []

    async def main() -> None:
        actx, ctx = zmq.asyncio.Context(), zmq.Context()
        pull = actx.socket(zmq.PULL)
        pull.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        try:
            for m in msgs:
                push.send(pack(m))
            await asyncio.wait_for(read_engine(pull, on_message, failures.append), 10)
        finally:
            push.close(linger=0)
            pull.close(linger=0)
            ctx.term()
            actx.term()

    asyncio.run(main())
    return failures


def test_read_engine_hands_on_messages_until_the_engine_is_dead(tmp_path):
    seen: list[Any] = []
    failures = _read(tmp_path, [("out", 1), ("out", 2), ("dead", "it crashed"), ("out", 3)],
                     seen.append)
    assert seen == [["out", 1], ["out", 2]] and failures == ["it crashed"]


def test_read_engine_stops_at_a_message_the_front_end_fails_on(tmp_path):
    seen: list[Any] = []

    def on_message(msg: list[Any]) -> None:
        seen.append(msg)
        if msg[1] == 2:
            raise KeyError("no such request")

    failures = _read(tmp_path, [("out", 1), ("out", 2), ("out", 3)], on_message)
    assert seen == [["out", 1], ["out", 2]]
    assert failures == ["the server failed to process the engine's outputs ('no such request')"]


def test_send_nowait_raises_while_no_core_is_connected(tmp_path):
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.bind(f"ipc://{tmp_path}/in")
    try:
        with pytest.raises(EngineDeadError, match="not connected"):
            send_nowait(push, ("add", 1))
        pull = ctx.socket(zmq.PULL)
        pull.connect(f"ipc://{tmp_path}/in")
        assert push.poll(5000, zmq.POLLOUT)
        send_nowait(push, ("add", 1))
        assert pull.poll(5000) and pull.recv() == pack(("add", 1))
        pull.close(linger=0)
    finally:
        push.close(linger=0)
        ctx.term()
