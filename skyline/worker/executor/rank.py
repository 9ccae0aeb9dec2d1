"""A rank's process: joins the process group, builds its ModelRunner over its part of the
model, then runs every step the engine broadcasts until told to stop.

Channels (multiproc.py binds them): the engine publishes (PUB) frames
  [b"hello"] | [b"step", SchedulerOutput] | [b"collect"] | [b"query", (id, name, args)]
  | [b"shutdown"]
and every rank pushes (PUSH) msgpack tuples back:
  ("hello", rank) | ("ready", rank, info) | ("out", rank, RunnerOutput) (the driver only)
  | ("kv", rank, kv_finished, kv_failed) (the other ranks, with a KV connector)
  | ("result", rank, id, pickled value) | ("error", rank, one sentence, is a ConfigError)
  | ("beat", rank)
A thread of the rank's beats every second on a socket of its own, so that the engine can tell
a rank that is busy (loading, a long step) from one that is gone; the rank exits when the
process that started it does.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from skyline.worker.executor.codec import decode_step, encode_output, pack, unpack

log = logging.getLogger(__name__)

BEAT_SECONDS = 1.0
STORE_PREFIX = "skyline/"  # keys of the engine's rendezvous store


@dataclass(frozen=True)
class RankAddress:
    """Where a rank finds its engine: the rendezvous store."""

    host: str
    port: int
    rank: int
    cpu_threads: int  # torch's threads on a CPU rank (spawn.cpu_rank_threads)
    env: dict[str, str]  # the rank's environment (the engine's, multicast off)


def open_store(host: str, port: int, timeout_s: float) -> Any:
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def exit_with_parent() -> None:
    """Exit at once when the process that started this one is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _beat(ctx: Any, addr: str, rank: int) -> None:
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    msg = pack(("beat", rank))
    while True:
        sock.send(msg)
        time.sleep(BEAT_SECONDS)


def run_rank(where: RankAddress, log_level: int) -> None:
    """Entry point of a rank's process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when ranks stop
    exit_with_parent()
    # before anything of skyline reads it, and before NCCL starts
    os.environ.clear()
    os.environ.update(where.env)
    logging.basicConfig(level=log_level,
                        format=f"%(levelname)s %(name)s [rank {where.rank}]: %(message)s")
    import zmq

    store = open_store(where.host, where.port, 600)
    config = pickle.loads(store.get(STORE_PREFIX + "config"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(store.get(STORE_PREFIX + "steps").decode())
    out_addr = store.get(STORE_PREFIX + "results").decode()
    # the results socket has a context of its own: terminating it at exit waits until what
    # was sent (an error's sentence, above all) has left, where os._exit would drop it
    out_ctx = zmq.Context()
    push = out_ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(out_addr)
    threading.Thread(target=_beat, args=(ctx, out_addr, where.rank), daemon=True,
                     name="beat").start()
    rank = where.rank
    while sub.recv_multipart()[0] != b"hello":  # subscribed: nothing later is missed
        pass
    push.send(pack(("hello", rank)))
    try:
        t0 = time.perf_counter()
        runner = _start(config, where, store)
        from skyline.worker.queries import QUERIES

        log.info("ready in %.1f s (model loaded in %.1f s)", time.perf_counter() - t0,
                 runner.load_seconds)
        from skyline.worker.gc_tuning import tune_gc

        tune_gc()  # a rank's step loop allocates as the engine's does
        push.send(pack(("ready", rank, {"num_blocks": runner.num_blocks,
                                               "max_num_seqs": runner.max_num_seqs})))
        driver = runner.layout.driver
        while True:
            frames = sub.recv_multipart()
            kind = frames[0]
            if kind in (b"step", b"collect"):
                prev = runner.launch(decode_step(frames[1])) if kind == b"step" \
                    else runner.collect()
                if prev is None:
                    pass
                elif driver:
                    push.send(pack(("out", rank, encode_output(prev))))
                elif runner.connector is not None:  # each rank's transfers end on their own
                    push.send(pack(("kv", rank, prev.kv_finished, prev.kv_failed)))
            elif kind == b"query":
                call_id, name, args = unpack(frames[1])
                value = QUERIES[name](runner, *args)
                push.send(pack(("result", rank, call_id, pickle.dumps(value))))
            elif kind == b"shutdown":
                runner.shutdown()  # the KV tiers finish their writes
                break
    except Exception as e:
        from skyline.config import ConfigError

        user = isinstance(e, ConfigError)  # a setting to fix: the sentence says what to do
        if not user:
            traceback.print_exc()
        message = str(e) if user else f"{type(e).__name__}: {e}"
        push.send(pack(("error", rank, message, user)))
        push.close(linger=5000)
        out_ctx.term()
        os._exit(1)
    push.close(linger=5000)
    out_ctx.term()
    sub.close(linger=0)
    # No teardown of the process group: NCCL's can hang in it after CUDA graphs captured its
    # collectives, and every peer exits alike.
    os._exit(0)


def _start(config: Any, where: RankAddress, store: Any) -> Any:
    """Join the process group and build this rank's runner."""
    import torch
    import torch.distributed as dist

    from skyline.parallel.groups import init_layout
    from skyline.parallel.placement import Stage
    from skyline.worker.runner import ModelRunner

    pc = config.parallel
    stages = [Stage(*s) for s in pc.stages]
    index = where.rank // pc.tensor_parallel_size
    stage = stages[index]
    if stage.device == "cuda":  # the GPU of this rank's place on its host
        stage = stages[index] = Stage(f"cuda:{where.rank % pc.ranks_per_node}", stage.start,
                                      stage.end)
    if stage.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(stage.device))
        if pc.threads or not pc.n_cpu_moe:  # one host thread, as engine/create/assemble.py's
            torch.set_num_threads(pc.threads or 1)
    else:  # the host's cores shared by its CPU ranks (those left to them)
        torch.set_num_threads(pc.threads or where.cpu_threads)
    t0 = time.perf_counter()
    layout = init_layout(where.rank, stages, pc.tensor_parallel_size,
                         dist.PrefixStore(STORE_PREFIX + "pg", store), pc.timeout_s,
                         pc.expert_parallel, pc.n_cpu_moe)
    log.info("joined the process group in %.1f s", time.perf_counter() - t0)
    return ModelRunner(config, layout)
