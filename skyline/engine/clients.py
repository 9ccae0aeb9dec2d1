"""One engine core behind several API processes (`skyline serve --api-server-count N`).

The parent process keeps the engine core (SharedEngineSupervisor: spawn, watch, restart with
backoff, give up, exactly as EngineSupervisor does for one API process) but reads none of its
outputs. Each API process (EngineClient, index 0..N-1) binds its own input and output sockets
per engine generation, ipc://DIR/in-G-I and ipc://DIR/out-G-I; the core connects to all of them
(engine/process.py), so each request's outputs reach only the process that sent it.

The parent tells the API processes over a pipe each, in this order for each generation:
("gen", g) before g starts (bind its sockets, which the core connects to while it loads),
("up", g, info, num_restarts) once it serves, ("down", g, message) when it dies (fail what is
in flight with `message`, the same sentence a single API process gives), ("fatal", reason,
message) when the restart limit is reached. An API process asks the parent for
("restart", g, reason) when generation g failed in a way only it saw (the core's "dead"
message, or outputs it could not process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing.connection
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from skyline.engine.codec import pack
from skyline.engine.process import EngineProcess
from skyline.engine.supervisor import (
    EngineDeadError,
    EngineSupervisor,
    RestartPolicy,
    _Link,
    failure_message,
    read_engine,
    send_nowait,
)

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # for the core to connect to a new generation's sockets


def client_addr(ipc_dir: str, kind: str, gen: int, client: int | str) -> str:
    return f"ipc://{ipc_dir}/{kind}-{gen}-{client}"


class SharedEngineSupervisor(EngineSupervisor):
    """The engine core of `num_clients` API processes, kept by the parent process; `notify(msg)`
    sends a control message to every API process. Only "shutdown" goes to the core from here,
    on a control socket of its own (in-G-ctl)."""

    def __init__(self, args: Any, startup_timeout: float | None, policy: RestartPolicy,
                 num_clients: int, notify: Callable[[Any], None],
                 on_fatal: Callable[[str], None] = lambda reason: None) -> None:
        self.num_clients, self.notify = num_clients, notify
        self._fatal = on_fatal
        super().__init__(args, startup_timeout, policy, on_message=lambda msg: None,
                         on_death=self._down, on_restart=self._up, on_fatal=self._give_up_all)

    @property
    def ipc_dir(self) -> str:
        return self._dir

    def state(self) -> dict[str, Any]:
        """What a new API process starts from: the generation whose sockets to bind (the one
        being started, while one is), what it serves and whether it serves now."""
        gen = self._pending.gen if self._pending is not None else self.link.gen
        return {"gen": gen, "info": self.info, "dead": self.dead,
                "num_restarts": self.num_restarts, "failed": self.failed}

    def restart_requested(self, gen: int, reason: str) -> None:
        """An API process saw generation `gen` fail: restart it (once, whoever asks)."""
        if gen == self.link.gen:
            self._died(self.link, reason)

    def _sockets(self, gen: int) -> _Link:
        self.notify(("gen", gen))
        ctl = self._ctx.socket(zmq.PUSH)
        ctl.setsockopt(zmq.SNDHWM, 0)
        ctl.bind(client_addr(self._dir, "in", gen, "ctl"))
        return _Link(gen, None, ctl, None)

    def _spawn(self, gen: int) -> EngineProcess:
        n = range(self.num_clients)
        return EngineProcess(
            self.args, [*(client_addr(self._dir, "in", gen, i) for i in n),
                        client_addr(self._dir, "in", gen, "ctl")],
            [client_addr(self._dir, "out", gen, i) for i in n], self.startup_timeout)

    def _down(self, message: str) -> None:
        self.notify(("down", self.link.gen, message))

    def _up(self) -> None:
        self.notify(("up", self.link.gen, self.info, self.num_restarts))

    def _give_up_all(self, reason: str) -> None:
        self.notify(("fatal", reason, self.dead))
        self._fatal(reason)


class EngineClient:
    """One API process's link to the shared engine core, with EngineSupervisor's interface
    for AsyncLLM (`info`, `dead`, `num_restarts`, `start`, `send`, `shutdown`) and its
    callbacks, driven by the parent's control messages instead of a process it owns."""

    def __init__(self, ipc_dir: str, client: int, control: multiprocessing.connection.Connection,
                 state: dict[str, Any], on_message: Callable[[list[Any]], None],
                 on_death: Callable[[str], None], on_restart: Callable[[], None] = lambda: None,
                 on_fatal: Callable[[str], None] = lambda reason: None) -> None:
        self.ipc_dir, self.client, self.control = ipc_dir, client, control
        self.on_message, self.on_death = on_message, on_death
        self.on_restart, self.on_fatal = on_restart, on_fatal
        self.info: dict[str, Any] = state["info"]
        self.dead: str | None = state["dead"]
        self.num_restarts: int = state["num_restarts"]
        self.failed: bool = state["failed"]
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self.gen = -1
        self.inp: zmq.Socket | None = None
        self.out: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = self._closed = False
        self._bind(state["gen"])
        if self.dead is None:
            self._hello()

    @property
    def pid(self) -> int | None:
        return self.info.get("pid")

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        """Begin following the parent and reading the engine (needs the event loop)."""
        if self._started or self._closed:
            return
        self._started = True
        asyncio.get_running_loop().add_reader(self.control.fileno(), self._on_control)
        if self.dead is None:
            self._read_from(self.gen)

    def send(self, msg: Any) -> None:
        """As EngineSupervisor.send; "add" and "call" carry this process's client index."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if msg[0] in ("add", "call"):
            msg = (*msg, self.client)
        assert self.inp is not None
        send_nowait(self.inp, msg)

    def ask(self, msg: Any) -> None:
        """A message to the parent (("ready", ...), ("restart", gen, reason), ...)."""
        with contextlib.suppress(OSError):
            self.control.send(msg)

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop reading and close the sockets (the parent stops the engine). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            self.dead = "the server is shutting down"
        if self._started:
            with contextlib.suppress(Exception):  # no loop (or a closed one): nothing to remove
                asyncio.get_running_loop().remove_reader(self.control.fileno())
        self._unbind()
        self._ctx.term()
        self._actx.term()

    # ------------------------------------------------------------------ internals

    def _bind(self, gen: int) -> None:
        self._unbind()
        self.gen = gen
        self.inp = self._ctx.socket(zmq.PUSH)
        self.inp.setsockopt(zmq.SNDHWM, 0)  # sends never wait (unbounded queue)
        self.inp.bind(client_addr(self.ipc_dir, "in", gen, self.client))
        self.out = self._actx.socket(zmq.PULL)
        self.out.bind(client_addr(self.ipc_dir, "out", gen, self.client))

    def _unbind(self) -> None:
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None
        for sock in (self.inp, self.out):
            if sock is not None:
                sock.close(linger=0)
        self.inp = self.out = None

    def _hello(self) -> None:
        """Open this generation: the core drops what a predecessor at this index left running.
        The core connects to our sockets as it starts; wait (briefly) until it has."""
        assert self.inp is not None
        if not self.inp.poll(int(HELLO_TIMEOUT_S * 1000), zmq.POLLOUT):
            log.warning("the engine core has not connected to API process %d yet", self.client)
        with contextlib.suppress(zmq.Again):
            self.inp.send(pack(("hello", self.client)), zmq.NOBLOCK)

    def _read_from(self, gen: int) -> None:
        assert self.out is not None
        self._task = asyncio.get_running_loop().create_task(
            read_engine(self.out, self.on_message, lambda reason: self._lost(gen, reason)))

    def _lost(self, gen: int, reason: str) -> None:
        """Generation `gen` failed as only this process saw: fail what is in flight now, and
        have the parent restart the engine."""
        self.ask(("restart", gen, reason))
        self._down(gen, failure_message(reason))

    def _down(self, gen: int, message: str) -> None:
        if gen != self.gen or self.dead is not None or self._closed:
            return
        self.dead = message
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None
        log.error("engine core (pid %s) is down: %s", self.pid, message)
        self.on_death(message)

    def _on_control(self) -> None:
        try:
            while self.control.poll():
                self._control(self.control.recv())
        except (EOFError, OSError):  # the parent is gone (this process exits with it)
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.control.fileno())

    def _control(self, msg: list[Any]) -> None:
        if self._closed:
            return
        kind = msg[0]
        if kind == "gen":
            self._bind(msg[1])
        elif kind == "down":
            self._down(msg[1], msg[2])
        elif kind == "up":
            _, gen, info, num_restarts = msg
            if gen != self.gen:
                self._bind(gen)
            self.info, self.num_restarts = info, num_restarts
            self._hello()
            self.dead = None
            self._read_from(gen)
            self.on_restart()
        elif kind == "fatal":
            self.failed, self.dead = True, msg[2]
            self._unbind()
            self.on_fatal(msg[1])
