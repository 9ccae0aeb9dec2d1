"""Prefill/decode KV transfer: the worker's half of cache/pd.py, a transport behind the KV
connector's calls (base.py).

Over ZMQ on TCP (any two hosts, and the CPU's path): the prefill replica binds a ROUTER socket
(`kv_transfer_port`, reported by `info` and the server's GET /fleet) and a thread answers
pulls. A send transfer (KV_SEND) registers a finished request's blocks under its transfer id;
a decode replica's load (KV_LOAD) pulls them by chained hash, in chunks of CHUNK_BYTES: the
prefill side gathers a chunk's payloads (codec.py: a block's K and V across layers as one row
of bytes) while the decode side writes the previous one into its fresh blocks. Frames:
  decode -> prefill: [b"pull", transfer id, msgpack(keys)]
  prefill -> decode: [b"data", msgpack(positions), payloads] ... then [b"end"];
                     [b"unknown"] while the send is not registered yet (the decode side asks
                     again for up to PULL_WAIT_S: the router asks it as soon as the prefill
                     answered, which can be before the send's step started).
A key the prefill side does not hold, a peer that does not answer within REPLY_TIMEOUT_S, any
error: those blocks fail, and the scheduler recomputes them (from the first that failed).
A send ends once pulled, or after its ttl_s unpulled (then reported with every block failed).

On CUDA the gathers and scatters run on side streams, behind an event of the compute stream
recorded when the transfer started (the blocks' earlier users), and are synchronized before
a transfer is reported ended.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from skyline.config import EngineConfig
from skyline.types import KV_LOAD, KV_SEND, KVTransfer
from skyline.worker.connector.base import KVConnector
from skyline.worker.connector.codec import BlockCodec

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
PULL_WAIT_S = 5.0
REPLY_TIMEOUT_S = 10.0


def _pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False)


@dataclass
class _Send:
    op_id: int
    index: dict[bytes, int]  # key -> device block id
    deadline: float
    serving: bool = False  # a pull is reading its blocks: it cannot expire now


@dataclass
class _Stats:
    bytes: int = 0
    seconds: float = 0.0
    blocks: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class PDTransport(KVConnector):
    def __init__(self, config: EngineConfig, kv_caches: list[torch.Tensor]) -> None:
        self.role = config.fleet.role
        self.codec = BlockCodec(kv_caches, "auto")
        self.device = kv_caches[0].device
        self.cuda = self.device.type == "cuda"
        self.chunk = max(1, CHUNK_BYTES // self.codec.payload_bytes)
        self.ctx = zmq.Context()
        self._lock = threading.Condition()
        self._in_flight: set[int] = set()
        self._ended: list[tuple[int, list[int]]] = []  # (op id, failed block indexes)
        self._sends: dict[str, _Send] = {}
        self._stop = threading.Event()
        self.stats_sent = _Stats()
        self.stats_loaded = _Stats()
        self.pool = cf.ThreadPoolExecutor(4, thread_name_prefix="kv-pull")
        self.pull_wait_s = PULL_WAIT_S
        self.port: int | None = None
        self._server: threading.Thread | None = None
        if self.role == "prefill":
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            host = config.fleet.kv_events_host
            where = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            if config.fleet.kv_transfer_port:
                sock.bind(f"{where}:{config.fleet.kv_transfer_port}")
                self.port = config.fleet.kv_transfer_port
            else:
                self.port = sock.bind_to_random_port(where)
            self._server = threading.Thread(target=self._serve, args=(sock,),
                                            name="kv-transfer", daemon=True)
            self._server.start()

    def info(self) -> dict[str, Any]:
        return {"kv_transfer_port": self.port, "payload_bytes": self.codec.payload_bytes}

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def _ready_event(self) -> Any:
        """An event on the compute stream now: what ran before it is behind the copies."""
        if not self.cuda:
            return None
        e = torch.cuda.Event()
        e.record()
        return e

    # ---------------------------------------------------------------- runner's thread

    def start(self, transfers: Sequence[KVTransfer]) -> None:
        for t in transfers:
            with self._lock:
                self._in_flight.add(t.op_id)
            if t.kind == KV_SEND:
                assert t.params is not None
                send = _Send(t.op_id, dict(zip(t.keys, t.block_ids, strict=True)),
                             time.monotonic() + float(t.params["ttl_s"]))
                with self._lock:
                    self._sends[str(t.params["transfer_id"])] = send
            elif t.kind == KV_LOAD:
                self.pool.submit(self._pull, t, self._ready_event())
            else:
                raise ValueError(f"the prefill/decode transport does not do {t.kind!r}")

    def poll(self) -> tuple[list[int], dict[int, list[int]]]:
        now = time.monotonic()
        with self._lock:
            for tid, send in list(self._sends.items()):
                if now > send.deadline and not send.serving:
                    del self._sends[tid]
                    self._ended.append((send.op_id, list(range(len(send.index)))))
            ended, self._ended = self._ended, []
            for op_id, _ in ended:
                self._in_flight.discard(op_id)
        return [op for op, _ in ended], {op: bad for op, bad in ended if bad}

    def wait(self, timeout: float) -> None:
        with self._lock:
            if not self._ended:
                self._lock.wait(timeout)

    def _end(self, op_id: int, failed: list[int]) -> None:
        with self._lock:
            self._ended.append((op_id, failed))
            self._lock.notify_all()

    def stats(self) -> dict[str, Any]:
        out = {}
        for name, s in (("sent", self.stats_sent), ("loaded", self.stats_loaded)):
            out[f"pd_{name}_bytes"] = s.bytes
            out[f"pd_{name}_seconds"] = s.seconds
        return out

    def shutdown(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.ctx.term()

    # ---------------------------------------------------------------- prefill: serve pulls

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[1] != b"pull":
                    continue
                ident, tid = frames[0], frames[2].decode("utf-8", "replace")
                try:
                    self._answer(sock, ident, tid, _unpack(frames[3]))
                except Exception:  # a bad request or a bug: this pull fails, the server lives
                    log.exception("a KV pull for %s failed", tid)
        finally:
            sock.close(linger=0)

    @torch.inference_mode()
    def _answer(self, sock: zmq.Socket, ident: bytes, tid: str, keys: list[bytes]) -> None:
        with self._lock:
            send = self._sends.get(tid)
            if send is None:
                sock.send_multipart([ident, b"unknown"])
                return
            send.serving = True
        t0 = time.perf_counter()
        ok = False
        try:
            held = [(i, send.index[k]) for i, k in enumerate(keys) if k in send.index]
            stream = torch.cuda.Stream(self.device) if self.cuda else None
            for a in range(0, len(held), self.chunk):
                part = held[a : a + self.chunk]
                ids = torch.tensor([b for _, b in part], dtype=torch.int64)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        payload = self.codec.gather(ids.to(self.device)).to("cpu")
                    stream.synchronize()
                else:
                    payload = self.codec.gather(ids)
                sock.send_multipart([ident, b"data", _pack([i for i, _ in part]),
                                     memoryview(payload.numpy())])
                self.stats_sent.bytes += payload.numel()
            self.stats_sent.blocks += len(held)
            ok = True
        finally:
            sock.send_multipart([ident, b"end"])
            self.stats_sent.seconds += time.perf_counter() - t0
            with self._lock:
                self._sends.pop(tid, None)
            # pulled once: the blocks go back (a failed pull leaves the decode side to
            # recompute what it did not get)
            self._end(send.op_id, [] if ok else list(range(len(send.index))))

    # ---------------------------------------------------------------- decode: pull

    @torch.inference_mode()
    def _pull(self, t: KVTransfer, ready: Any) -> None:
        assert t.params is not None
        failed = set(range(len(t.keys)))
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        stream = torch.cuda.Stream(self.device) if self.cuda else None
        if stream is not None and ready is not None:
            stream.wait_event(ready)
        t0 = time.perf_counter()
        try:
            sock.connect(t.params["peer"])
            request = [b"pull", str(t.params["transfer_id"]).encode(), _pack(t.keys)]
            give_up = time.monotonic() + self.pull_wait_s
            sock.send_multipart(request)
            while sock.poll(REPLY_TIMEOUT_S * 1000):
                frames = sock.recv_multipart()
                if frames[0] == b"end":
                    break
                if frames[0] == b"unknown":
                    if time.monotonic() > give_up:
                        break
                    time.sleep(0.01)
                    sock.send_multipart(request)
                    continue
                positions = _unpack(frames[1])
                payload = torch.frombuffer(bytearray(frames[2]), dtype=torch.uint8)
                self._write(t, positions, payload.view(len(positions), -1), stream)
                failed.difference_update(positions)
                self.stats_loaded.bytes += payload.numel()
            if stream is not None:
                stream.synchronize()
        except Exception:
            log.exception("pulling KV for %s from %s failed; the request computes it",
                          t.params.get("transfer_id"), t.params.get("peer"))
        finally:
            sock.close(linger=0)
        self.stats_loaded.seconds += time.perf_counter() - t0
        self.stats_loaded.blocks += len(t.keys) - len(failed)
        self._end(t.op_id, sorted(failed))

    def _write(self, t: KVTransfer, positions: list[int], payload: torch.Tensor,
               stream: Any) -> None:
        ids = torch.tensor([t.block_ids[i] for i in positions], dtype=torch.int64)
        if stream is None:
            self.codec.scatter(payload, ids)
            return
        with torch.cuda.stream(stream):
            self.codec.scatter(payload.to(self.device), ids.to(self.device))
