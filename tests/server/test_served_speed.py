"""The API process's fast paths: pre-serialized text chunks, merged deltas of a reader that
fell behind, and the ceiling benchmark's smoke run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from skyline.engine.frontend.async_llm import RequestStream
from skyline.engine.frontend.output import merge_deltas
from skyline.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from skyline.server.serving import TextChunks, sse
from skyline.types import CompletionOutput, RequestOutput, TokenLogprobs

TEXTS = ["", " hello", "a\nb\tc\r", 'quote " and \\ back', "\x00\x01\x1f\x7f", "é 日本 🙂",
         "\u2028\u2029", "</script>", "\ud7ff\ue000", "{\"x\": [1]}"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_text_chunks_are_the_bytes_pydantic_writes(kind: str) -> None:
    def build(i: int, text: str) -> CompletionResponse | ChatCompletionChunk:
        if kind == "completion":
            return CompletionResponse(id="cmpl-1", created=7, model="m",
                                      choices=[CompletionChoice(index=i, text=text)])
        return ChatCompletionChunk(id="chat-1", created=7, model="m",
                                   choices=[ChatChunkChoice(index=i,
                                                            delta=DeltaMessage(content=text))])

    chunks = TextChunks(build)
    for i in (0, 3):
        for t in TEXTS:
            assert chunks(i, t) == sse(build(i, t)), (i, t)


def _out(text: str, ids: list[int], finish: str | None = None,
         lps: list[TokenLogprobs] | None = None, metrics: dict[str, float] | None = None,
         prompt_lps: list[TokenLogprobs | None] | None = None) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], [CompletionOutput(0, text, ids, finish, None, lps)],
                         finish is not None, 1, metrics or {}, prompt_lps)


def test_merge_deltas_concatenates_in_order() -> None:
    lp = TokenLogprobs([5], [-0.5], 1)
    a = _out(" a", [5], lps=[lp], metrics={"ttft": 0.1}, prompt_lps=[None])
    b = _out(" b", [6], lps=[lp])
    c = _out(" c", [7], finish="length", lps=[lp], metrics={"e2e": 1.0})
    m = merge_deltas(merge_deltas(a, b), c)
    assert m.outputs[0].text == " a b c" and m.outputs[0].token_ids == [5, 6, 7]
    assert m.outputs[0].logprobs == [lp, lp, lp]
    assert m.finished and m.outputs[0].finish_reason == "length"
    assert m.metrics == {"ttft": 0.1, "e2e": 1.0} and m.prompt_logprobs == [None]


class _Owner:
    def __init__(self) -> None:
        self.released: list[tuple[str, bool]] = []

    def _release(self, rid: str, finished: bool) -> None:
        self.released.append((rid, finished))


def test_a_stream_that_fell_behind_reads_its_waiting_deltas_as_one() -> None:
    async def go() -> None:
        q: asyncio.Queue = asyncio.Queue()
        owner = _Owner()
        s = RequestStream(owner, "r", q, 2)  # type: ignore[arg-type]
        for i in range(3):
            q.put_nowait(_out(f" t{i}", [i]))
        first = await s.__anext__()
        assert first.outputs[0].text == " t0 t1 t2" and not s.finished
        q.put_nowait(_out(" t3", [3]))
        q.put_nowait(_out(" t4", [4], finish="stop"))
        q.put_nowait(_out(" never", [9]))  # after the end: not read
        last = await s.__anext__()
        assert last.outputs[0].text == " t3 t4" and last.finished
        with pytest.raises(StopAsyncIteration):
            await s.__anext__()
        # an error behind waiting deltas: the deltas first, then the error
        q2: asyncio.Queue = asyncio.Queue()
        s2 = RequestStream(owner, "r2", q2, 2)  # type: ignore[arg-type]
        q2.put_nowait(_out(" x", [1]))
        q2.put_nowait(ValueError("boom"))
        assert (await s2.__anext__()).outputs[0].text == " x"
        with pytest.raises(ValueError, match="boom"):
            await s2.__anext__()
        assert owner.released == [("r2", False)]

    asyncio.run(go())


def _smoke(script: str, tmp_path: str) -> str:
    """Run bench/`script` --smoke; its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, os.path.join(root, "bench", script), "--smoke"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_serve_ceiling_smoke(tmp_path: str) -> None:
    out = _smoke("serve_ceiling.py", tmp_path)
    row = json.loads(next(line for line in out.splitlines() if "api_ceiling" in line))
    assert row["window_tokens"] > 0 and row["requests_done"] > 0
    # no event-loop stall: /health answered throughout (a generous bound for a loaded CI)
    assert 0 < row["health_max_ms"] < 2000, row


def test_served_vs_offline_smoke(tmp_path: str) -> None:
    out = _smoke("served_vs_offline.py", tmp_path)
    path = [line for line in out.splitlines() if line.startswith("wrote ")][-1][len("wrote "):]
    with open(path) as f:
        result = json.load(f)
    # one offline run, then served with one API process and with two, then with one at half
    # the offline run's request rate (Poisson arrivals)
    runs = result["runs"]
    assert [(r["api_server_count"], r["rate_of_offline"]) for r in runs] == [
        (1, None), (2, None), (1, 0.5)], out
    offline_rps = result["offline_output_tok_s"] / result["output_len"]
    assert runs[2]["request_rate"] == pytest.approx(0.5 * offline_rps)
    assert result["failed"] == 0 and result["offline_output_tok_s"] > 0, out
    for r in runs:
        assert r["served_output_tok_s"] > 0 and r["served"]["completed"] == 16, r
        # TTFT of the first wave (the 8 users' first requests) and of the 8 after it
        waves = r["served"]["ttft_first_wave_ms"], r["served"]["ttft_after_first_wave_ms"]
        assert all(w["median"] > 0 for w in waves), r
        # the served engine's steps (SKYLINE_STEP_TRACE): each request's tokens after its
        # first came from decode rows
        steps = r["served"]["steps"]
        assert steps["mixed_decode_tokens"] + steps["decode_tokens"] >= 16 * 15, steps
    assert result["offline"]["steps"]["steps"] > 0
