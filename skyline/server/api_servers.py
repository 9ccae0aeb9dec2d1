"""`skyline serve --api-server-count N`: N API processes in front of one engine core.

One API process (HTTP, SSE encoding and detokenization on one event loop) can deliver fewer
streamed tokens than the engine produces at hundreds of streams on a GPU. With N, the
parent process binds the listening socket once and hands it to N spawned API processes, each
its own FastAPI/uvicorn app, tokenizer, detokenizer and event loop. The parent binds the port
before anything starts, N times with SO_REUSEPORT (Linux >= 3.9), and hands one socket to each
API process: the kernel spreads new connections evenly over the N accept queues by their
addresses. One socket shared by all would be simpler, but every process wakes for each new
connection and the first to run accepts all that are waiting (asyncio accepts up to the backlog
at once), so a burst of clients (a load test's 256 users) piles onto one process. Binding in the
parent keeps `--port 0` (bound once, then the same port N - 1 times) and a bind error one
sentence before the engine loads, and a socket outlives its API process: connections queued
while one is restarted wait for its successor.

The parent keeps the engine core (engine/clients.py's SharedEngineSupervisor: restarts with
backoff, the same error body in every API process while it is down) and the API processes:
one that exits unexpectedly is started again at its index (the engine drops what its
predecessor left running), at most --max-engine-restarts times in ten minutes, after which the
server stops with one sentence. SIGTERM / Ctrl-C: every API process drains (--shutdown-timeout)
and exits, then the engine core stops; every child exits with the parent if it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from skyline.engine.clients import EngineClient, SharedEngineSupervisor
from skyline.engine.process import EngineStartError, exit_with_parent
from skyline.engine.supervisor import (
    EngineDeadError,
    RestartPolicy,
    RestartWindow,
    exit_description,
)
from skyline.server.app import CUT_GRACE_S, banner, run_app
from skyline.server.launch import ServeOptions, bind_socket

log = logging.getLogger("skyline.server")

# prometheus_client reads it when a process imports it: set here, inherited by the API processes
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STOP_GRACE_S = 10.0  # beyond the drain, for an API process to exit before it is killed


# ---------------------------------------------------------------------------------- child


def run_api_server(index: int, sock: socket.socket, control: multiprocessing.connection.Connection,
                   ipc_dir: str, state: dict[str, Any], options: ServeOptions,
                   metrics_dir: str, log_levels: dict[str, int]) -> None:
    """Entry point of API process `index` (spawned): tells the parent ("ready", pid, tool
    format) or ("error", one sentence), then serves until SIGTERM."""
    exit_with_parent()
    # A terminal's Ctrl-C reaches the whole process group: the parent forwards it as SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_levels.get("", logging.WARNING),
                        format=f"%(levelname)s %(name)s [api {index}]: %(message)s")
    for name, level in log_levels.items():
        logging.getLogger(name).setLevel(level)
    from skyline.engine.frontend.async_llm import AsyncLLM

    servers: list[Any] = []

    def on_fatal(reason: str) -> None:
        for s in servers:
            s.should_exit = True

    def link(**callbacks: Any) -> EngineClient:
        return EngineClient(ipc_dir, index, control, state, **callbacks)

    try:
        llm = AsyncLLM(None, on_fatal=on_fatal, max_waiting=options.max_waiting,
                       chat_template=options.chat_template, link=link, id_prefix=f"a{index}:")
    except Exception as e:
        control.send(("error", f"API process {index} failed to start ({type(e).__name__}: {e})"))
        return

    def announce(fmt: str | None) -> None:
        llm.engine.ask(("ready", os.getpid(), fmt))

    try:
        run_app(llm, sock, options, servers, announce, api_server=index,
                multiprocess_dir=metrics_dir)
    finally:
        llm.shutdown()
        sock.close()


# ---------------------------------------------------------------------------------- parent


def _log_levels() -> dict[str, int]:
    """The levels the command set up here (the root's, and request ids logged at INFO), for
    an API process to log as one process would."""
    return {name: logging.getLogger(name).getEffectiveLevel()
            for name in ("", "skyline", "skyline.server", "skyline.router", "skyline.progress")}


@dataclass
class _Child:
    index: int
    proc: Any  # multiprocessing.Process
    conn: multiprocessing.connection.Connection
    ready: asyncio.Future[Any]
    exited: bool = False


class ApiServers:
    """The parent: the engine core's supervisor and N API processes."""

    def __init__(self, engine_args: Any, count: int, socks: list[socket.socket],
                 options: ServeOptions, policy: RestartPolicy, metrics_dir: str) -> None:
        self.count, self.socks, self.options = count, socks, options
        self.policy, self.metrics_dir = policy, metrics_dir
        self.children: list[_Child | None] = [None] * count
        self.stopping = False
        self.fatal: list[str] = []
        self.start_error: str | None = None
        self.crashes = RestartWindow(policy)
        self._all_exited: asyncio.Event | None = None
        self.engine = SharedEngineSupervisor(engine_args, None, policy, count, self.notify,
                                             on_fatal=self._on_fatal)

    def notify(self, msg: Any) -> None:
        for c in self.children:
            if c is not None and not c.exited:
                with contextlib.suppress(OSError):
                    c.conn.send(msg)

    def _spawn(self, index: int) -> _Child:
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=run_api_server, name=f"skyline-api-{index}",
            args=(index, self.socks[index], theirs, self.engine.ipc_dir, self.engine.state(),
                  self.options, self.metrics_dir, _log_levels()))
        proc.start()
        theirs.close()
        loop = asyncio.get_running_loop()
        child = _Child(index, proc, mine, loop.create_future())
        self.children[index] = child
        loop.add_reader(mine.fileno(), self._on_message, child)
        loop.add_reader(proc.sentinel, self._on_exit, child)
        return child

    def _on_message(self, child: _Child) -> None:
        try:
            while child.conn.poll():
                msg = child.conn.recv()
                if msg[0] in ("ready", "error") and not child.ready.done():
                    child.ready.set_result(msg)
                elif msg[0] == "restart":
                    self.engine.restart_requested(msg[1], msg[2])
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(child.conn.fileno())

    def _on_exit(self, child: _Child) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.proc.sentinel)
        with contextlib.suppress(Exception):
            loop.remove_reader(child.conn.fileno())
        child.proc.join(1)
        child.exited = True
        child.conn.close()
        if not child.ready.done():
            child.ready.set_result(("error", f"API process {child.index} exited during startup "
                                             f"(exit code {child.proc.exitcode})"))
        if self.stopping:
            if all(c is None or c.exited for c in self.children):
                assert self._all_exited is not None
                self._all_exited.set()
            return
        how = exit_description(child.proc.exitcode)
        delay = self.crashes.failed()
        if delay is None:
            self._on_fatal(f"API processes exited unexpectedly {len(self.crashes)} times in "
                           f"{self.policy.window_s / 60:.0f} minutes (the last: API process "
                           f"{child.index}, {how}); not restarting them again")
            return
        log.error("API process %d (pid %s) exited unexpectedly (%s); starting it again in %.1fs",
                  child.index, child.proc.pid, how, delay)
        loop.call_later(delay, self._respawn, child.index)

    def _respawn(self, index: int) -> None:
        if self.stopping:
            return
        child = self._spawn(index)
        child.ready.add_done_callback(lambda f: log.warning(
            "API process %d started again (pid %s)", index, child.proc.pid)
            if f.result()[0] == "ready" else log.error("%s", f.result()[1]))

    def _on_fatal(self, reason: str) -> None:
        self.fatal.append(reason)
        self.stop()

    def stop(self) -> None:
        """Drain and stop every API process (SIGTERM each), then the engine (in `run`)."""
        if self.stopping:
            return
        self.stopping = True
        assert self._all_exited is not None
        for c in self.children:
            if c is not None and not c.exited:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGTERM)
        if all(c is None or c.exited for c in self.children):
            self._all_exited.set()
        # Each drains for up to --shutdown-timeout and then cuts what still runs: one still
        # there well after that is stuck; killing it ends the wait (its sentinel fires).
        limit = self.options.shutdown_timeout + CUT_GRACE_S + STOP_GRACE_S
        asyncio.get_running_loop().call_later(limit, self.kill_children)

    async def run(self, host: str) -> None:
        loop = asyncio.get_running_loop()
        self._all_exited = asyncio.Event()
        self.engine.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        try:
            children = [self._spawn(i) for i in range(self.count)]
            answers = await asyncio.gather(*(c.ready for c in children))
            errors = [a[1] for a in answers if a[0] == "error"]
            if errors and not self.stopping:  # (stopped while starting: no error)
                self.start_error = errors[0]
                self.stop()
            else:
                print(banner(self.engine.info, host, self.socks[0].getsockname()[1], answers[0][2],
                             [a[1] for a in answers]), flush=True)
            await self._all_exited.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self.kill_children()
            self.engine.shutdown(10.0)
        print("skyline: server stopped", file=sys.stderr, flush=True)

    def kill_children(self) -> None:
        """Those that did not exit by themselves in time."""
        for c in self.children:
            if c is not None and c.proc.is_alive():
                c.proc.kill()
                c.proc.join(5)


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on host:port with SO_REUSEPORT; where the kernel refuses that
    (a sandbox's network stack may), one socket that every API process accepts on."""
    first = bind_socket(host, port, reuse_port=True)
    port = first.getsockname()[1]  # --port 0: the free one the first bind took
    socks = [first]
    try:
        socks += [bind_socket(host, port, reuse_port=True) for _ in range(count - 1)]
    except OSError as e:
        log.warning("cannot bind port %d %d times (%s); the %d API processes share one "
                    "listening socket", port, count, e, count)
        for s in socks[1:]:
            s.close()
        socks = [first] * count
    return socks


def serve_many(engine_args: Any, count: int, host: str, port: int, options: ServeOptions,
               policy: RestartPolicy) -> None:
    """`serve` with `count` API processes; raises as `serve` does."""
    socks = listening_sockets(host, port, count)
    metrics_dir = tempfile.mkdtemp(prefix="skyline-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    servers = None
    try:
        servers = ApiServers(engine_args, count, socks, options, policy, metrics_dir)
        asyncio.run(servers.run(host))
    finally:
        if servers is not None:
            servers.kill_children()
            servers.engine.shutdown(10.0)
        os.environ.pop(MULTIPROC_ENV, None)
        for s in set(socks):
            s.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if servers.start_error is not None:
        raise EngineStartError(servers.start_error)
    if servers.fatal:
        raise EngineDeadError(f"{servers.fatal[0]}; the server stopped")
