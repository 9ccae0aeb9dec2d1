"""One process per rank: the engine broadcasts each step's SchedulerOutput to every rank and
reads one RunnerOutput back, from the rank that samples (the driver).

Rendezvous is torch.distributed's: the engine holds a TCPStore (on 127.0.0.1 for one host,
on --distributed-init's address across hosts) in which it leaves its config and the addresses
of its two ZMQ sockets; ranks it spawns, and those `skyline worker` starts on other hosts,
read them there and join the process group through the same store. Steps go out on a PUB
socket (one send reaches every rank), outputs come back on a PULL socket (codec.py keeps the
messages small: a decode step of a thousand requests is its request ids and counts).

With async scheduling the engine launches step n + 1 before reading step n's tokens, as with
one process: the ranks queue n + 1, then the driver waits for n's tokens and sends them.

A rank that raises, exits, is killed or goes silent (no beat for --distributed-timeout
seconds; a local rank's exit is seen at once) stops the engine with one `RankError` naming the
rank and the cause; the other ranks are stopped. The engine never waits without looking at
its ranks: every wait polls the output socket in short slices.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import time
import weakref
from typing import Any

from skyline.config import ConfigError, EngineConfig
from skyline.parallel.groups import driver_rank
from skyline.types import RunnerOutput, SchedulerOutput
from skyline.worker.connector.base import ReportMerger
from skyline.worker.executor.base import Executor
from skyline.worker.executor.codec import StepEncoder, decode_output, pack, unpack
from skyline.worker.executor.rank import STORE_PREFIX
from skyline.worker.executor.spawn import (
    exit_reason,
    node_ranks,
    parse_init,
    spawn_ranks,
    stop_processes,
)

log = logging.getLogger(__name__)

POLL_MS = 100


class RankError(RuntimeError):
    """A rank failed, exited or went silent; the engine has stopped. One sentence says which
    rank and why."""


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        import torch.distributed as dist
        import zmq

        pc = config.parallel
        if pc.node_rank != 0:
            raise ConfigError("the engine runs on node 0; start the ranks of the other nodes "
                              "with `skyline worker --distributed-init ... --node-rank N`")
        self.world = pc.world_size
        self.driver = driver_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self.timeout_s = pc.timeout_s
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self._error: Exception | None = None
        self._starting = True  # until every rank is ready
        self._closed = False
        self._in_flight = False
        self._encoder = StepEncoder()
        self._calls = itertools.count()
        self._heard: dict[int, float] = {}
        self._checked = 0.0
        self._early: list[Any] = []  # messages that came during the handshake
        # With a KV connector every rank reports its own transfers (a "kv" message beside the
        # driver's output); a rank's report of the next step may come before a slower rank's
        # of this one.
        self._merger = ReportMerger(self.world) if config.offload.enabled else None
        self._ahead: dict[int, list[Any]] = {}
        host, port = parse_init(pc.distributed_init)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=pc.timeout_s))
        self.ctx = zmq.Context()
        # every socket's default: closing (or collecting) them never waits on unsent messages
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self._dir = None
        if pc.nnodes == 1:  # unix sockets: the fastest way between processes of one host
            self._dir = tempfile.mkdtemp(prefix="skyline-ranks-")
            steps, results = f"ipc://{self._dir}/steps", f"ipc://{self._dir}/results"
            self.pub.bind(steps)
            self.pull.bind(results)
        else:
            steps = f"tcp://{host}:{self.pub.bind_to_random_port('tcp://*')}"
            results = f"tcp://{host}:{self.pull.bind_to_random_port('tcp://*')}"
        self.store.set(STORE_PREFIX + "config", pickle.dumps(config))
        self.store.set(STORE_PREFIX + "steps", steps)
        self.store.set(STORE_PREFIX + "results", results)
        try:
            self.procs = spawn_ranks(config, node_ranks(config, 0), host, self.store.port)
            # An executor dropped without shutdown still stops its ranks.
            weakref.finalize(self, stop_processes, list(self.procs.values()))
            self._handshake()
            ready = self._gather("ready")
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = int(ready[self.driver][0]["num_blocks"])
        self.max_num_seqs = int(ready[self.driver][0]["max_num_seqs"])
        self._starting = False
        log.info("%d ranks ready (tensor parallel %d, %d pipeline stages)", self.world,
                 pc.tensor_parallel_size, pc.pipeline_parallel_size)

    # -- the Executor interface ----------------------------------------------------------------

    def launch(self, out: SchedulerOutput) -> RunnerOutput | None:
        self._send(b"step", self._encoder.encode(out))
        had, self._in_flight = self._in_flight, not out.empty
        return self._output() if had else None

    def collect(self) -> RunnerOutput:
        assert self._in_flight, "no step in flight"
        self._send(b"collect")
        self._in_flight = False
        return self._output()

    def query(self, name: str, *args: Any) -> Any:
        """Run the query on every rank (a model's forward needs them all); the driver's answer,
        or queries.COMBINE's of all of them."""
        from skyline.worker.queries import COMBINE, ONE_RANK

        if name in ONE_RANK and self.world > 1:
            raise ConfigError(f"the {name} query needs the whole model in one process; run "
                              "it without --tensor-parallel-size or --pipeline-parallel-size")
        call_id = next(self._calls)
        self._send(b"query", pack((call_id, name, args)))
        results = self._gather("result", call_id)
        values = [pickle.loads(results[r][0]) for r in range(self.world)]
        combine = COMBINE.get(name)
        return combine(values, self.driver) if combine is not None else values[self.driver]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._error is None and any(p.is_alive() for p in self.procs.values()):
            with contextlib.suppress(Exception):
                self.pub.send_multipart([b"shutdown"])
            deadline = time.monotonic() + 10
            for p in self.procs.values():
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- messages ------------------------------------------------------------------------------

    def _send(self, kind: bytes, payload: bytes | None = None) -> None:
        if self._error is not None:
            raise self._error
        self.pub.send_multipart([kind] if payload is None else [kind, payload])

    def _output(self) -> RunnerOutput:
        if self._merger is None:
            return decode_output(self._step_message(self._next(), self.driver)[2])
        got = {r: q.pop(0) for r, q in self._ahead.items() if q}
        while len(got) < self.world:
            msg = self._next()
            if msg[1] in got:
                self._ahead.setdefault(msg[1], []).append(msg)
            else:
                got[msg[1]] = msg
        out = decode_output(self._step_message(got.pop(self.driver), self.driver)[2])
        reports = [out] + [RunnerOutput(kv_finished=m[2], kv_failed=m[3])
                           for m in (self._step_message(m, -1) for m in got.values())]
        self._merger.merge(reports, out)
        return out

    def _step_message(self, msg: list[Any], driver: int) -> list[Any]:
        """`msg`, checked to be the driver's output (or another rank's KV report)."""
        if msg[0] != ("out" if msg[1] == driver else "kv"):
            raise self._fail(f"rank {msg[1]} sent {msg[0]!r} where the step's output was due")
        return msg

    def _gather(self, kind: str, call_id: int | None = None) -> dict[int, list[Any]]:
        """One `kind` message from every rank: rank -> its fields after the rank."""
        got: dict[int, list[Any]] = {}
        while len(got) < self.world:
            msg = self._next()
            if msg[0] != kind or (call_id is not None and msg[2] != call_id):
                raise self._fail(f"rank {msg[1]} sent {msg[0]!r} where {kind!r} was due")
            got[msg[1]] = msg[3:] if call_id is not None else msg[2:]
        return got

    def _handshake(self) -> None:
        """Publish hellos until every rank has answered: a rank subscribed by then misses
        nothing later. Ranks of other hosts have --distributed-timeout seconds to show up."""
        deadline = time.monotonic() + self.timeout_s
        seen: set[int] = set()
        while len(seen) < self.world:
            self.pub.send_multipart([b"hello"])
            msg = self._next(wait_ms=50)
            if msg is not None and msg[0] == "hello":
                seen.add(msg[1])
            elif msg is not None:  # a quick rank is ready already
                self._early.append(msg)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - seen)
                raise self._fail(f"ranks {missing} did not join within {self.timeout_s:.0f} s; "
                                 "start `skyline worker` on every other node")

    def _next(self, wait_ms: int | None = None) -> Any:
        """The next message of a rank other than a beat (None after `wait_ms`); raises
        RankError as soon as a rank fails, exits or goes silent."""
        import zmq

        if self._error is not None:
            raise self._error
        if self._early and wait_ms is None:
            return self._early.pop(0)
        start = time.monotonic()
        while True:
            if self.pull.poll(POLL_MS if wait_ms is None else wait_ms):
                msg = unpack(self.pull.recv(zmq.NOBLOCK))
                self._heard[msg[1]] = time.monotonic()
                if msg[0] == "error":
                    self._raise(msg)
                if msg[0] != "beat":
                    return msg
            now = time.monotonic()
            if now - self._checked > POLL_MS / 1000:
                self._checked = now
                self._check(now)
            if wait_ms is not None and now - start > wait_ms / 1000:
                return None

    def _check(self, now: float) -> None:
        for r, p in self.procs.items():
            if p.exitcode is not None:
                if p.exitcode > 0:  # a rank that raised said why before it exited
                    self._drain_errors(wait_s=3.0)
                raise self._fail(f"rank {r} (pid {p.pid}) {exit_reason(p.exitcode)}")
        for r in range(self.world):
            if r not in self.procs and now - self._heard.get(r, now) > self.timeout_s:
                raise self._fail(f"rank {r} has not been heard from for {self.timeout_s:.0f} s")

    def _raise(self, msg: list[Any]) -> None:
        """Stop on a rank's ("error", rank, sentence, is a ConfigError)."""
        _, rank, text, user = msg
        if user and self._starting:
            raise self._fail(text, ConfigError)  # at start-up: a setting to fix
        raise self._fail(self._cause(f"rank {rank} failed: {text}", rank))

    def _drain_errors(self, wait_s: float) -> None:
        """Raise the first error a rank sent (reading for up to `wait_s`), if any."""
        import zmq

        deadline = time.monotonic() + wait_s
        while self.pull.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            msg = unpack(self.pull.recv(zmq.NOBLOCK))
            if msg[0] == "error":
                self._raise(msg)

    def _cause(self, message: str, rank: int) -> str:
        """A rank that fails may only be the first to see a peer die (its collective broke):
        the peer's death, if one follows within a second, is the cause to report."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for r, p in self.procs.items():
                if r != rank and p.exitcode is not None and p.exitcode != 1:
                    return f"rank {r} (pid {p.pid}) {exit_reason(p.exitcode)}"
            time.sleep(0.05)
        return message

    def _fail(self, message: str, kind: type[Exception] = RankError) -> Exception:
        """Stop every rank; the error to raise now and at every later call."""
        if self._error is None:
            self._error = kind(message) if kind is ConfigError else \
                kind(f"{message}; the engine stopped")
            log.error("%s", self._error)
            self._kill()
        return self._error

    def _kill(self) -> None:
        stop_processes(list(self.procs.values()))
