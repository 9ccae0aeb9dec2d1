"""What chat and text completions share (server/serving.py), without a server: the usage
block, stream_options, and collecting a whole response while watching for the client leaving."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from skyline.engine.supervisor import EngineDeadError
from skyline.server.errors import APIError
from skyline.server.protocol import StreamOptions
from skyline.server.serving import Choice, collect_whole, make_usage, stream_usage


def test_usage_counts_every_choices_tokens():
    u = make_usage(7, [Choice(num_tokens=3), Choice(num_tokens=4)], 5)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (7, 7, 14)
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens == 5


@pytest.mark.parametrize("opts,want", [
    (None, (False, False)),
    (StreamOptions(include_usage=True), (True, False)),
    (StreamOptions(continuous_usage_stats=True), (False, False)),  # no usage at all asked for
    (StreamOptions(include_usage=True, continuous_usage_stats=True), (True, True)),
])
def test_stream_usage(opts, want):
    assert stream_usage(opts) == want


class _Client:
    """An ASGI request's receive(): the client leaves when `left` is set."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}


def _collect(work_outcome: str) -> tuple[Any, list[str]]:
    """collect_whole over work that finishes, fails or outlives its client: (what it returned
    or raised, what happened after)."""
    events: list[str] = []

    async def main() -> Any:
        client = _Client()

        async def work() -> bool:
            if work_outcome == "dead":
                raise EngineDeadError("the engine is restarting")
            if work_outcome == "client leaves":
                client.left.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    events.append("cancelled")
                    raise
            return True

        try:
            return await collect_whole(client, "r1", work(), lambda: events.append("done"))
        except APIError as e:
            return e

    return asyncio.run(asyncio.wait_for(main(), 10)), events


def test_collect_whole_finished():
    assert _collect("finishes") == (True, ["done"])


def test_collect_whole_client_left_cancels_the_work():
    assert _collect("client leaves") == (False, ["cancelled", "done"])


def test_collect_whole_engine_dead_is_a_503():
    err, events = _collect("dead")
    assert isinstance(err, APIError) and err.status == 503 and events == ["done"]
