"""Prefill/decode disaggregation as a KV connector (cache/connector.py): the scheduler's half.

The router (router/pd.py) sends a long prompt first to a prefill replica, with
`kv_transfer_params` {"transfer_id": T, "do_remote_decode": true} and one output token, then
to a decode replica with {"transfer_id": T, "peer": "tcp://host:port"} (the prefill replica's
transfer socket).
- prefill: when such a request finishes, `request_finished` holds its blocks in a send
  transfer (KV_SEND) keyed by the chained hashes of its full blocks; the worker's half
  (worker/connector/pd.py) serves them to the first peer that pulls T, and the transfer ends
  (the blocks are freed) once they are pulled, or after `ttl_s`.
- decode: at admission, every prompt block past the device's own prefix hits is to be loaded
  from the peer (`num_matched_blocks`); the worker pulls them into fresh device blocks while
  other requests run. Blocks the peer does not have (evicted, expired, a dead peer) fail, and
  the request computes them itself from the first one that failed: the same tokens, later.
Only requests that carry the parameters move KV; every other request runs as on any engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from skyline.cache.block_pool import BlockPool
from skyline.cache.connector import KVConnectorScheduler, LoadEnded
from skyline.cache.prefix import BlockHash, hash_token_blocks
from skyline.types import KV_LOAD, KV_SEND, KVTransfer, Request, RequestStatus

SEND_TTL_S = 60.0  # a prefill replica holds a finished request's blocks this long at most


class PDConnector(KVConnectorScheduler):
    """`payload_bytes`: one block's KV bytes (all layers), for the transfer-rate counters."""

    def __init__(self, role: str, block_size: int, payload_bytes: int = 0,
                 ttl_s: float = SEND_TTL_S) -> None:
        assert role in ("prefill", "decode")
        self.role = role
        self.block_size = block_size
        self.payload_bytes = payload_bytes
        self.ttl_s = ttl_s
        self._started: dict[int, float] = {}  # load op id -> when its step started it
        self._next_op = 0
        self._planned: list[KVTransfer] = []
        self._ops: dict[int, KVTransfer] = {}  # started, not reported ended
        self.counts: dict[str, float] = dict.fromkeys(
            ("pd_sent_blocks", "pd_send_expired", "pd_loaded_blocks", "pd_load_failed_blocks",
             "pd_loaded_bytes", "pd_load_seconds"), 0)

    def attach(self, pool: BlockPool) -> None:
        pass

    def _new(self, kind: str, keys: list[bytes], block_ids: list[int], request: Request,
             params: dict) -> int:
        op = KVTransfer(self._next_op, kind, keys, block_ids, request_id=request.request_id,
                        params=params)
        self._next_op += 1
        self._planned.append(op)
        self._ops[op.op_id] = op
        return op.op_id

    @staticmethod
    def _params(request: Request) -> dict | None:
        return request.sampling_params.kv_transfer_params

    # ---------------------------------------------------------------- decode

    def num_matched_blocks(self, request: Request, hashes: Sequence[BlockHash], start: int,
                           stop: int) -> int:
        p = self._params(request)
        if self.role != "decode" or not p or not p.get("peer"):
            return 0
        # The prefill replica computed the whole prompt: every block past our own hits.
        return max(0, stop - start)

    def load(self, request: Request, hashes: Sequence[BlockHash],
             block_ids: Sequence[int]) -> int:
        p = self._params(request)
        assert p is not None
        return self._new(KV_LOAD, list(hashes), list(block_ids), request,
                         {"peer": p["peer"], "transfer_id": p["transfer_id"]})

    # ---------------------------------------------------------------- prefill

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> int | None:
        p = self._params(request)
        if (self.role != "prefill" or not p or not p.get("do_remote_decode")
                or request.status is RequestStatus.FINISHED_ABORTED):
            return None
        # Full blocks whose KV was computed (the last sampled token has none).
        n = min(len(block_ids), min(request.num_computed_tokens, request.num_tokens - 1)
                // self.block_size)
        if n == 0:
            return None
        keys = hash_token_blocks(request.all_token_ids[: n * self.block_size], self.block_size)
        return self._new(KV_SEND, keys, list(block_ids[:n]), request,
                         {"transfer_id": p["transfer_id"], "ttl_s": self.ttl_s})

    # ---------------------------------------------------------------- both

    def build(self) -> list[KVTransfer]:
        out, self._planned = self._planned, []
        now = time.monotonic()
        for op in out:
            if op.kind == KV_LOAD:
                self._started[op.op_id] = now
        return out

    def update(self, finished: Sequence[int], failed: dict[int, list[int]]) -> list[LoadEnded]:
        ended = []
        for op_id in finished:
            op = self._ops.pop(op_id, None)
            if op is None:
                continue
            bad = failed.get(op_id, [])
            if op.kind == KV_SEND:
                # the worker reports an unpulled, expired send as all its blocks failed
                key = "pd_send_expired" if bad else "pd_sent_blocks"
                self.counts[key] += 1 if bad else len(op.keys)
                continue
            good = min(bad) if bad else len(op.keys)
            # from the step that started it to the step that saw it end: the rate a request
            # sees (concurrent loads overlap)
            self.counts["pd_load_seconds"] += time.monotonic() - self._started.pop(op_id)
            self.counts["pd_loaded_bytes"] += (len(op.keys) - len(bad)) * self.payload_bytes
            self.counts["pd_loaded_blocks"] += good
            self.counts["pd_load_failed_blocks"] += len(op.keys) - good
            ended.append(LoadEnded(op_id, good))
        return ended

    @property
    def num_in_flight(self) -> int:
        return len(self._ops)

    def stats(self) -> dict[str, float]:
        return dict(self.counts)
