"""The engine core in its own process, so that HTTP and tokenization never stall the model loop.

The API process binds two ZMQ sockets and spawns `run_engine_core`, which connects to both:
  input  (API -> core): ("add", request) | ("abort", ids) | ("call", call_id, method, args)
                        | ("shutdown",)
  output (core -> API): ("out", step_outputs, stats, queue_times) | ("add_error", id, message)
                        | ("result", call_id, value) | ("dead", message)
Every message is msgpack; the dataclasses travel through engine/codec.py's helpers, not pickle.
Startup goes over a multiprocessing pipe: ("ready", info) or ("error", one sentence).

Several API processes (`serve --api-server-count N`, engine/clients.py): each binds its own
input and output socket and the core connects to all of them (its one PULL socket fair-queues
the inputs; one PUSH socket per API process). An API process's "add" and "call" carry its
client index as a last element, and ("hello", client) opens each of its connections (the core
aborts whatever it still runs for that index: a replaced API process's requests). The core
sends each request's outputs, add errors and call results to its owner only, batched per
client per step; stats go to every client, each with its own `num_adds`.

The loop blocks on the input socket while idle; with work it drains the input without waiting,
runs one step and pushes the outputs. The process exits when its parent dies. With
FleetConfig.kv_events_port set, it also publishes its KV events (engine/kv_events.py) after
each step and answers snapshot requests between steps.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from typing import Any

from skyline import envs
from skyline.engine.loop import EngineLoop, QueueTimes
from skyline.types.startup import StartupPhases, expand, format_phases
from skyline.worker.executor.rank import exit_with_parent  # also the API processes'

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- child


def run_engine_core(args: Any, in_addrs: list[str], out_addrs: list[str],
                    conn: multiprocessing.connection.Connection, log_level: int,
                    progress_level: int = logging.WARNING, spawned_at: float | None = None
                    ) -> None:
    """Entry point of the engine-core process (spawned); `progress_level`: the parent's
    `skyline.progress` logger's (skyline/progress.py); `spawned_at`: the wall-clock time the
    parent spawned it (the start-up record's first phase)."""
    started = StartupPhases()
    if spawned_at is not None:  # the interpreter's start and this module's imports
        started.add("spawn", time.time() - spawned_at)
    t0 = time.perf_counter()
    # The parent decides when the engine stops (after draining requests on SIGTERM / Ctrl-C,
    # which a terminal or supervisor may send to the whole process group).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    logging.getLogger("skyline.progress").setLevel(progress_level)
    from skyline.config import ConfigError
    from skyline.engine.core import EngineCore, tune_gc
    from skyline.engine.create import create_engine_config
    from skyline.engine.frontend.llm import load_tokenizer
    from skyline.engine.frontend.structured import structured_outputs
    from skyline.engine.step_trace import StepTrace

    started.add("imports", time.perf_counter() - t0)
    queue_times = QueueTimes()
    # SKYLINE_STEP_TRACE: every step's shape and seconds, for bench/served_vs_offline.py
    trace = StepTrace() if envs.ENV.step_trace else None
    try:
        with started.phase("config"):
            config, auto_len = create_engine_config(args)
        structured = structured_outputs(config.model, lambda: load_tokenizer(config.model))
        with started.phase("engine"):
            core = EngineCore(config, max_model_len_auto=auto_len, structured=structured,
                              observers=[queue_times] + ([trace] if trace else []))
    except (ConfigError, ValueError, FileNotFoundError, MemoryError) as e:
        conn.send(("error", str(e)))
        return
    except Exception as e:  # a bug: keep the traceback in the log, give the parent one line
        traceback.print_exc()
        conn.send(("error", f"the engine failed to start ({type(e).__name__}: {e})"))
        return
    t1 = time.perf_counter()
    cfg = core.config
    events = None
    if cfg.fleet.kv_events_port is not None:
        from skyline.engine.kv_events import KVEventPublisher

        try:
            events = KVEventPublisher(cfg.fleet.kv_events_host, cfg.fleet.kv_events_port)
        except OSError as e:
            core.shutdown()
            conn.send(("error", str(e)))
            return
    info = {
        "model_name": cfg.model.name, "model_path": cfg.model.path,
        "load_format": cfg.model.load_format, "dtype": cfg.model.dtype, "device": cfg.device,
        "max_model_len": core.max_model_len, "vocab_size": cfg.model.arch.vocab_size,
        "eos_token_ids": list(cfg.model.arch.eos_token_ids),
        "block_size": cfg.cache.block_size, "max_waiting": cfg.scheduler.max_waiting,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "role": cfg.fleet.role, "kv_events_port": cfg.fleet.kv_events_port,
        "kv_transfer_port": (core.kv_connector_info or {}).get("kv_transfer_port"),
        "pid": os.getpid(),
        **core.executor.describe(),
    }
    loop = EngineLoop(core, queue_times, in_addrs, out_addrs, events)
    tune_gc()
    # The runner's phases in place of the engine's; "engine_other": the scheduler, the
    # executor's own work (a rank process each with several), KV events, the loop's sockets.
    started.add("engine", time.perf_counter() - t1)
    info["startup"] = expand(started.seconds, "engine", info.get("startup", {}))
    log.info("engine core started in %.1f s: %s", sum(info["startup"].values()),
             format_phases(info["startup"]))
    conn.send(("ready", info))
    conn.close()
    if trace is not None:
        trace.clock = lambda: core.executor.query("step_clocks")
        trace.reset()
    try:
        loop.run()
    except Exception as e:
        traceback.print_exc()
        loop.broadcast(("dead", f"the engine failed: {type(e).__name__}: {e}"))
        loop.close()
        core.shutdown()
        os._exit(1)
    loop.close()
    if trace is not None:
        trace.write(envs.ENV.step_trace)
    core.shutdown()


# ---------------------------------------------------------------------------------- parent


class EngineStartError(RuntimeError):
    """The engine could not start; the message says why in one sentence."""


class EngineProcess:
    """Spawns the engine core and waits for it to be ready; `info` describes what it serves.
    `in_addr` / `out_addr`: the API process's sockets, or lists of them (several API processes:
    the outputs of client i go to out_addr[i]; the inputs may have more, e.g. a control
    socket)."""

    def __init__(self, args: Any, in_addr: str | list[str], out_addr: str | list[str],
                 startup_timeout: float | None = None) -> None:
        in_addrs = [in_addr] if isinstance(in_addr, str) else list(in_addr)
        out_addrs = [out_addr] if isinstance(out_addr, str) else list(out_addr)
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_engine_core, name="skyline-engine",
            args=(args, in_addrs, out_addrs, send,
                  logging.getLogger("skyline").getEffectiveLevel(),
                  logging.getLogger("skyline.progress").getEffectiveLevel(), time.time()),
        )
        self.proc.start()
        send.close()
        deadline = None if startup_timeout is None else time.monotonic() + startup_timeout
        try:
            msg = self._wait(recv, deadline)
        except BaseException:
            self.kill()
            raise
        finally:
            recv.close()
        if msg[0] == "error":
            self.proc.join(10)
            self.kill()
            raise EngineStartError(msg[1])
        self.info: dict[str, Any] = msg[1]

    def _wait(self, recv: multiprocessing.connection.Connection, deadline: float | None) -> Any:
        while True:
            try:
                if recv.poll(0.2):
                    return recv.recv()
            except EOFError:
                pass
            if not self.proc.is_alive():
                raise EngineStartError(
                    f"the engine process exited during startup (exit code {self.proc.exitcode})"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError("the engine did not start in time")

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def join(self, timeout: float) -> None:
        self.proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
