"""The prefill/decode KV transport between two workers over real ZMQ sockets (CPU tensors):
blocks arrive byte for byte by key, keys the prefill side lacks fail, an unknown transfer
fails after the wait, and an unpulled send expires; the scheduler's half turns the reports
into loads that end at the first failed block."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from skyline.cache.pd import PDConnector
from skyline.config import FleetConfig
from skyline.types import KV_LOAD, KV_SEND, KVTransfer, Request, SamplingParams
from skyline.worker.connector.pd import PDTransport

SHAPE = (2, 12, 4, 2, 8)  # [K/V, blocks, block_size, kv heads, head_dim]


def transport(role: str, caches: list[torch.Tensor]) -> PDTransport:
    return PDTransport(SimpleNamespace(fleet=FleetConfig(role=role)), caches)


def ended(t: PDTransport, timeout: float = 10.0) -> tuple[list[int], dict[int, list[int]]]:
    deadline = time.monotonic() + timeout
    while True:
        done, failed = t.poll()
        if done or time.monotonic() > deadline:
            return done, failed
        t.wait(0.05)


def test_pull_by_key_missing_keys_fail():
    src = [torch.randn(SHAPE) for _ in range(3)]
    dst = [torch.zeros(SHAPE) for _ in range(3)]
    p, d = transport("prefill", src), transport("decode", dst)
    try:
        p.start([KVTransfer(0, KV_SEND, [b"k0", b"k1", b"k2"], [3, 5, 7],
                            params={"transfer_id": "t", "ttl_s": 30})])
        peer = f"tcp://127.0.0.1:{p.info()['kv_transfer_port']}"
        d.start([KVTransfer(9, KV_LOAD, [b"k0", b"k2", b"kx"], [1, 2, 4],
                            params={"peer": peer, "transfer_id": "t"})])
        assert ended(d) == ([9], {9: [2]})
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(t[:, 1], s[:, 3]) and torch.equal(t[:, 2], s[:, 7])
            assert not t[:, 4].any()
        assert ended(p) == ([0], {})  # pulled: the prefill side frees its blocks
        assert p.stats()["pd_sent_bytes"] == d.stats()["pd_loaded_bytes"] > 0
    finally:
        p.shutdown()
        d.shutdown()


def test_unknown_transfer_and_expired_send():
    p, d = transport("prefill", [torch.randn(SHAPE)]), transport("decode", [torch.zeros(SHAPE)])
    d.pull_wait_s = 0.3
    try:
        peer = f"tcp://127.0.0.1:{p.info()['kv_transfer_port']}"
        d.start([KVTransfer(1, KV_LOAD, [b"a", b"b"], [0, 1],
                            params={"peer": peer, "transfer_id": "nope"})])
        assert ended(d) == ([1], {1: [0, 1]})
        p.start([KVTransfer(2, KV_SEND, [b"a"], [0], params={"transfer_id": "t", "ttl_s": 0.1})])
        time.sleep(0.2)
        assert ended(p) == ([2], {2: [0]})
    finally:
        p.shutdown()
        d.shutdown()


def test_connector_plans_and_reports():
    params = {"transfer_id": "t", "peer": "tcp://127.0.0.1:1"}
    dec = PDConnector("decode", 4)
    req = Request("r", list(range(18)), SamplingParams(kv_transfer_params=params))
    plain = Request("q", list(range(18)), SamplingParams())
    assert dec.num_matched_blocks(plain, [], 0, 4) == 0
    assert dec.num_matched_blocks(req, [], 1, 4) == 3
    op = dec.load(req, [b"h1", b"h2", b"h3"], [7, 8, 9])
    (t,) = dec.build()
    assert (t.kind, t.block_ids, t.params) == (KV_LOAD, [7, 8, 9], params)
    (end,) = dec.update([op], {op: [1, 2]})
    assert end.num_blocks == 1 and dec.num_in_flight == 0
    pre = PDConnector("prefill", 4)
    done = Request("s", list(range(10)), SamplingParams(
        kv_transfer_params={"transfer_id": "t", "do_remote_decode": True}))
    done.num_computed_tokens = 10
    done.append_output_token(5)
    op = pre.request_finished(done, [4, 5, 6])
    (t,) = pre.build()
    assert t.kind == KV_SEND and t.block_ids == [4, 5] and len(t.keys) == 2
    assert pre.request_finished(plain, [1]) is None
