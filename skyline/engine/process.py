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

from skyline.engine.codec import pack, request_from_dict, step_output_to_list, unpack
from skyline.types import StepOutput
from skyline.types.startup import StartupPhases, expand, format_phases
from skyline.worker.executor.rank import exit_with_parent  # also the API processes'

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- child


class _QueueTimes:
    """A step observer: the seconds each request waited before its first schedule (the
    queue-time metric), from the arrivals the loop records."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}  # request id -> arrival, until first scheduled
        self.seconds: dict[str, float] = {}  # first scheduled since the last report

    def __call__(self, out: Any, scheduled_at: float, seconds: float) -> None:
        for new in out.new_requests:
            arrival = self.arrivals.pop(new.request_id, None)
            if arrival is not None:
                self.seconds[new.request_id] = scheduled_at - arrival

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


class _EngineLoop:
    def __init__(self, core: Any, queue_times: _QueueTimes, in_addrs: list[str],
                 out_addrs: list[str], events: Any = None) -> None:
        import zmq

        self.core = core
        self.queue_times = queue_times
        self.events = events  # a KVEventPublisher, or None
        self.ctx = zmq.Context()
        self.inp = self.ctx.socket(zmq.PULL)
        for addr in in_addrs:
            self.inp.connect(addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)
        if events is not None:
            self.poller.register(events.snapshots, zmq.POLLIN)
        self.outs = []  # one per client (API process), by client index
        for addr in out_addrs:
            out = self.ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow reader
            out.setsockopt(zmq.LINGER, 5000)
            out.connect(addr)
            self.outs.append(out)
        # requests added by each client, which lets the frontend count requests in flight to us
        self.num_adds = [0] * len(self.outs)
        # several clients: which one owns each request (its outputs go there only)
        self.owners: dict[str, int] = {}
        self.running = True
        self.stats_dirty = True

    def send(self, msg: Any, client: int = 0) -> None:
        self.outs[client].send(pack(msg))

    def stats(self) -> dict[str, Any]:
        s = dict(self.core.stats())
        s["max_model_len"] = self.core.max_model_len
        s["num_adds"] = self.num_adds[0]
        pool = self.core.scheduler.kv_manager.block_pool
        s["num_used_blocks"] = pool.num_blocks - pool.num_free_blocks  # 0 when idle
        return s

    def send_outputs(self, outputs: list[StepOutput], stats: dict[str, Any]) -> None:
        """One "out" message per client per step: its requests' outputs and queue times, and
        the engine's stats (every client reads them at scrape and for its waiting bound)."""
        queue_times = self.queue_times.take()
        if len(self.outs) == 1:
            self.send(("out", [step_output_to_list(o) for o in outputs], stats, queue_times))
            return
        owners = self.owners
        # queue times first: a request scheduled and finished in this step still has its owner
        times: list[dict[str, float]] = [{} for _ in self.outs]
        for rid, seconds in queue_times.items():
            times[owners.get(rid, 0)][rid] = seconds
        per_client: list[list[Any]] = [[] for _ in self.outs]
        for o in outputs:
            client = owners.get(o.request_id, 0)
            if o.finish_reason is not None:
                owners.pop(o.request_id, None)
            per_client[client].append(step_output_to_list(o))
        for client, outs in enumerate(per_client):
            self.send(("out", outs, {**stats, "num_adds": self.num_adds[client]},
                       times[client]), client)

    def _client(self, msg: list[Any], size: int) -> int:
        """The client index a message of `size` fields carries last (0 when it carries none);
        an index out of range (a bug) is client 0's."""
        client = msg[size] if len(msg) > size else 0
        return client if isinstance(client, int) and 0 <= client < len(self.outs) else 0

    def _abort(self, ids: list[str]) -> None:
        self.core.abort_requests(ids)
        for rid in ids:
            self.queue_times.arrivals.pop(rid, None)
            self.owners.pop(rid, None)

    def handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        self.stats_dirty = True
        if kind == "add":
            client = self._client(msg, 2)
            self.num_adds[client] += 1
            rid = str(msg[1].get("id")) if isinstance(msg[1], dict) else "?"
            try:
                req = request_from_dict(msg[1])
                # The front end validated it; validate again here, where a value the sampler
                # cannot hold would otherwise fail a whole step, not just this request.
                req.sampling_params.validate(self.core.config.model.arch.vocab_size)
                self.core.add_request(req)
            except Exception as e:  # a bad request must not take the engine down
                if not isinstance(e, ValueError):
                    log.exception("request %s could not be added", rid)
                self.send(("add_error", rid, str(e)), client)
                return
            self.queue_times.arrivals[req.request_id] = req.arrival_time
            if len(self.outs) > 1:
                self.owners[req.request_id] = client
        elif kind == "abort":
            self._abort(msg[1])
        elif kind == "hello":  # a (new) API process at this index: drop its predecessor's work
            client = self._client(msg, 1)
            self._abort([rid for rid, c in self.owners.items() if c == client])
            self.num_adds[client] = 0  # it counts its own adds from 0
        elif kind == "call":
            client = self._client(msg, 4)
            _, call_id, method, args = msg[:4]
            if method == "stats":
                value: Any = {**self.stats(), "num_adds": self.num_adds[client]}
            elif method == "reset_prefix_cache":
                value = self.core.scheduler.reset_prefix_cache()
            else:
                value = None
            self.send(("result", call_id, value), client)
        elif kind == "shutdown":
            self.running = False

    def drain(self, block: bool) -> None:
        import zmq

        while block and self.running:
            ready = dict(self.poller.poll(1000))
            self.publish_events(None)  # snapshot requests, heartbeats
            if self.inp in ready:
                break
        while self.running:
            try:
                data = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(unpack(data))

    def publish_events(self, stats: dict[str, Any] | None) -> None:
        """Publish the cache's events since the last call, then answer snapshot requests
        (in this order, so that a snapshot includes every event published)."""
        if self.events is None:
            return
        pool = self.core.scheduler.kv_manager.block_pool
        self.events.publish(pool.take_events(), stats if stats is not None else self.stats())
        self.events.answer_snapshots(pool.cached_hashes)

    def run(self) -> None:
        while self.running:
            self.drain(block=not self.core.has_unfinished())
            if not self.running:
                break
            if not self.core.has_unfinished():
                if self.stats_dirty:  # e.g. everything was aborted: report the freed cache
                    stats = self.stats()
                    self.send_outputs([], stats)
                    self.publish_events(stats)
                    self.stats_dirty = False
                continue
            outputs = self.core.step()
            stats = self.stats()
            self.send_outputs(outputs, stats)
            self.publish_events(stats)
            self.stats_dirty = False

    def broadcast(self, msg: Any) -> None:
        for client in range(len(self.outs)):
            self.send(msg, client)

    def close(self) -> None:
        self.inp.close(linger=0)
        for out in self.outs:
            out.close()
        self.ctx.term()
        if self.events is not None:
            self.events.close()


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

    started.add("imports", time.perf_counter() - t0)
    queue_times = _QueueTimes()
    trace = _step_trace()
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
    loop = _EngineLoop(core, queue_times, in_addrs, out_addrs, events)
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
        trace.wait_clock = lambda: core.executor.query("device_wait_seconds")
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
        _write_step_trace(trace)
    core.shutdown()


def _step_trace() -> Any:
    """SKYLINE_STEP_TRACE set: an observer of every step (engine/step_trace.py), for a served
    run's step shapes beside an offline run's (bench/served_vs_offline.py)."""
    from skyline import envs

    if not envs.ENV.step_trace:
        return None
    from skyline.engine.step_trace import StepTrace

    return StepTrace()


def _write_step_trace(trace: Any) -> None:
    import json

    from skyline import envs

    try:
        with open(envs.ENV.step_trace, "w") as f:
            json.dump(trace.summary(), f, indent=1)
    except OSError as e:
        log.warning("the step trace could not be written to %s: %s", envs.ENV.step_trace, e)


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
