"""`bench serve` against a server that closes the connection after each streamed response while
advertising keep-alive (as llama.cpp's llama-server does): every request must still succeed."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator

import pytest
from http_stub import read_request

from skyline.bench.serve import LoadSpec, run_serve_bench
from skyline.bench.workloads import WorkloadSpec


class _ClosingHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request, body = read_request(self)
        if request.startswith("GET /v1/models"):
            data = json.dumps({"data": [{"id": "m"}]}).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Keep-Alive: timeout=5, max=100\r\nContent-Length: "
                             + str(len(data)).encode() + b"\r\n\r\n" + data)
            return  # the socket closes here
        n = body["max_tokens"]
        events = [{"choices": [{"text": f" t{i}", "index": 0}]} for i in range(n)]
        events.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Keep-Alive: timeout=5, max=100\r\nTransfer-Encoding: chunked\r\n\r\n")
        for e in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            self.wfile.write(f"{len(e.encode()):x}\r\n{e}\r\n".encode())
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture()
def closing_server() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _ClosingHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_connection_closed_after_each_stream(closing_server: str) -> None:
    load = LoadSpec(base_url=closing_server, concurrency=1, num_requests=6, progress=False)
    res = run_serve_bench(load, WorkloadSpec("shared-prefix", "4", "3", system_prompt_len=4),
                          {}, print_table=False)
    assert (res["summary"]["completed"], res["summary"]["failed"]) == (6, 0)
    assert [r["output_len"] for r in res["requests"]] == [3] * 6
