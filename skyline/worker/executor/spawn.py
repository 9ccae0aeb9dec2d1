"""Starting a host's rank processes: the threads and OpenMP settings each takes, the fork
server that starts them, `skyline worker`'s ranks on another host, and stopping them
(multiproc.py's executor holds the engine's side)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import time
from typing import Any

from skyline import envs
from skyline.config import ConfigError, EngineConfig
from skyline.parallel.groups import NCCL_ENV
from skyline.worker.executor.rank import STORE_PREFIX, RankAddress, run_rank

log = logging.getLogger(__name__)


def parse_init(url: str | None) -> tuple[str, int]:
    """(host, port) of --distributed-init tcp://HOST:PORT; one host: a free local port."""
    if url is None:
        return "127.0.0.1", 0
    host, sep, port = url.removeprefix("tcp://").rpartition(":")
    if not url.startswith("tcp://") or not sep or not port.isdigit() or not host:
        raise ConfigError(f"--distributed-init must be tcp://HOST:PORT, got {url!r}")
    return host, int(port)


def node_ranks(config: EngineConfig, node_rank: int) -> list[int]:
    per = config.parallel.ranks_per_node
    return list(range(node_rank * per, (node_rank + 1) * per))


def run_node(init: str, node_rank: int, nnodes: int | None = None) -> int:
    """`skyline worker`: start this host's ranks of the engine whose store is at `init`; return
    when they end (or stop them when the engine is gone). Returns an exit code."""
    from skyline.worker.executor.rank import open_store

    host, port = parse_init(init)
    store = open_store(host, port, 600)  # waits for the engine to start
    config = pickle.loads(store.get(STORE_PREFIX + "config"))
    pc = config.parallel
    if nnodes is not None and nnodes != pc.nnodes:
        raise ConfigError(f"the engine at {init} expects --nnodes {pc.nnodes}, not {nnodes}")
    if not 0 < node_rank < pc.nnodes:
        raise ConfigError(f"--node-rank must be in 1..{pc.nnodes - 1} (node 0 is the engine's)")
    procs = spawn_ranks(config, node_ranks(config, node_rank), host, port, engine_here=False)
    log.info("ranks %s started", sorted(procs))
    while any(p.is_alive() for p in procs.values()):
        try:
            store.check([STORE_PREFIX + "config"])
        except Exception:  # the engine (and its store) is gone: so are its ranks
            log.error("the engine at %s is gone; stopping ranks %s", init, sorted(procs))
            stop_processes(list(procs.values()))
            return 1
        time.sleep(1.0)
    return max(p.exitcode or 0 for p in procs.values())


def process_context() -> Any:
    """Rank processes start fresh, never forked from the engine. Where it can, a fork server
    that has imported torch once starts them (in a tenth of a second, where each would take
    seconds to import torch again); skyline itself is imported in the rank, under the engine's
    environment (parallel/groups.NCCL_ENV added), which the rank takes over first."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zmq", "msgpack", "safetensors",
                                "gguf", "triton"])  # those missing are skipped
    return ctx


def cpu_rank_threads(cores: int, cpu_ranks: int, gpu_ranks: int, engine_here: bool) -> int:
    """torch's threads on each CPU rank of a host: the cores left after one for each GPU rank
    (its host thread launches the GPU's work) and one for the engine's process where it runs,
    shared by the CPU ranks. A CPU stage whose workers take every core stalls the processes
    each step waits for: the engine's loop, the GPU stage that feeds it."""
    return max(1, (cores - gpu_ranks - int(engine_here)) // max(1, cpu_ranks))


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Any:
    """`extra` in os.environ for the block (a rank process, and the fork server the first one
    starts, read it: OpenMP reads its settings once, when torch loads it)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_ranks(config: EngineConfig, ranks: list[int], host: str, port: int,
                engine_here: bool = True) -> dict[int, multiprocessing.process.BaseProcess]:
    """Start the processes of `ranks` on this host (the engine's, unless `engine_here` is
    False: `skyline worker` on another); they meet at the store on host:port."""
    pc = config.parallel
    devices = [pc.stages[r // pc.tensor_parallel_size][0] for r in ranks]
    num_cpu = sum(d == "cpu" for d in devices)
    threads = cpu_rank_threads(os.cpu_count() or 1, num_cpu, len(devices) - num_cpu, engine_here)
    omp = envs.omp_defaults(os.environ)  # the CLI's, for an engine in a user's own process too
    env = {**os.environ, **omp, **NCCL_ENV}
    level = logging.getLogger("skyline").getEffectiveLevel()
    procs = {}
    with _environ(omp):
        ctx = process_context()
        for r in ranks:
            # daemonic: gone with the engine even if it never called shutdown
            where = RankAddress(host, port, r, threads, env)
            p = ctx.Process(target=run_rank, args=(where, level), name=f"skyline-rank-{r}",
                            daemon=True)
            p.start()
            procs[r] = p
    return procs


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_processes(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate, then kill what is left."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
