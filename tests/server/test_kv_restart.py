"""The disk tier outlives the server: a restarted server (default model, CPU) answers a long
prompt it saw before from disk, with the same tokens."""

from __future__ import annotations

import json
import time

from prometheus_client.parser import text_string_to_metric_families

PROMPT = " ".join(f"Line {i}: the river runs north past the old mill and the station."
                  for i in range(60))
BLOCK = 16


def complete(server) -> dict:
    status, _, body = server.request("POST", "/v1/completions", {
        "model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return json.loads(body)


def disk_counter(server, name: str) -> float:
    _, _, body = server.request("GET", "/metrics")
    for f in text_string_to_metric_families(body.decode()):
        for s in f.samples:
            if s.name == f"skyline:{name}_total" and s.labels.get("tier") == "disk":
                return s.value
    raise AssertionError(f"no {name} for the disk tier")


def test_restarted_server_reads_the_prompt_from_disk(tmp_path, server_factory):
    flags = ("--kv-offload-disk", str(tmp_path / "kv"), "--kv-offload-policy", "eager",
             "--served-model-name", "m")
    first = server_factory(*flags)
    try:
        a = complete(first)
        n = a["usage"]["prompt_tokens"]
        assert n > 600
        deadline = time.monotonic() + 60
        while disk_counter(first, "kv_offload_stored_blocks") < n // BLOCK:
            assert time.monotonic() < deadline, "the prompt's blocks never reached the disk"
            time.sleep(0.2)
    finally:
        first.stop()  # SIGTERM: the engine ends its writes, then exits
    second = server_factory(*flags)
    try:
        b = complete(second)
        hits = disk_counter(second, "kv_offload_hit_tokens")
    finally:
        second.stop()
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert hits == (n - 1) // BLOCK * BLOCK  # every full block but the last token's
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == hits
