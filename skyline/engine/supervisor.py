"""Keeps the engine-core process running for the API process: connects it over ZMQ, notices at
once when it dies (its process sentinel, or the "dead" message it sends when its loop fails),
and starts a new one with backoff, up to a limit.

Each engine generation gets its own pair of sockets, so nothing an old engine sent can be read
as the new one's. While a generation is down, `dead` says why and every send raises
EngineDeadError; requests in flight were failed by the owner's `on_death`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from skyline.engine.codec import pack, unpack
from skyline.engine.process import EngineProcess, EngineStartError

log = logging.getLogger(__name__)

T = TypeVar("T")

RESTART_WINDOW_S = 600.0  # restarts counted against the limit: those of the last ten minutes
BACKOFF_FIRST_S = 0.5  # wait before the first restart of a window, doubled for each further one
BACKOFF_MAX_S = 30.0


class EngineDeadError(Exception):
    """The engine core is gone (crashed, restarting or shutting down): retry later."""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # within RESTART_WINDOW_S; beyond, give up (0: never restart)
    window_s: float = RESTART_WINDOW_S
    backoff_first_s: float = BACKOFF_FIRST_S
    backoff_max_s: float = BACKOFF_MAX_S

    def delay(self, num_recent: int) -> float:
        return min(self.backoff_first_s * 2 ** max(num_recent - 1, 0), self.backoff_max_s)


class RestartWindow:
    """The failures a RestartPolicy counts: those of its last `window_s`. The engine core's
    supervisor and the parent of several API processes (server/api_servers.py) each keep one."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: collections.deque[float] = collections.deque()

    def __len__(self) -> int:
        return len(self._times)

    def failed(self) -> float | None:
        """Count a failure now: the wait before restarting, or None past the policy's limit
        (give up)."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.policy.window_s:
            self._times.popleft()
        self._times.append(now)
        if len(self._times) > self.policy.max_restarts:
            return None
        return self.policy.delay(len(self._times))


def failure_message(reason: str) -> str:
    """What requests and /health say while the engine restarts."""
    return f"the engine failed and is restarting ({reason}); retry in a few seconds"


def exit_description(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


@dataclass
class _Link:
    """One engine generation: its process and the sockets that talk to it."""

    gen: int
    proc: EngineProcess | None
    inp: zmq.Socket
    out: zmq.asyncio.Socket | None  # None where the API processes own the output sockets
    task: asyncio.Task[None] | None = None
    down: bool = False
    watched: bool = False

    def close(self) -> None:
        self.inp.close(linger=0)
        if self.out is not None:
            self.out.close(linger=0)


def send_nowait(sock: zmq.Socket, msg: Any) -> None:
    """`msg` to the engine core on a PUSH socket with no send limit, which queues it at once;
    EngineDeadError while no core is connected (the send would wait for one)."""
    try:
        sock.send(pack(msg), zmq.NOBLOCK)
    except zmq.Again:
        raise EngineDeadError("the engine core is not connected; retry shortly") from None


async def read_engine(sock: zmq.asyncio.Socket, on_message: Callable[[list[Any]], None],
                      on_failure: Callable[[str], None]) -> None:
    """Hand each message of one engine generation to `on_message` until the engine says it is
    dead or the front end fails on one; then call `on_failure(reason)` once and return."""
    while True:
        msg = unpack(await sock.recv())
        if msg[0] == "dead":
            on_failure(msg[1])
            return
        try:
            on_message(msg)
        except Exception as e:  # a bug in the front end: start afresh, loudly
            log.exception("processing the engine's outputs failed")
            on_failure(f"the server failed to process the engine's outputs ({e})")
            return


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a daemon thread: blocking work (spawning and waiting for an engine) that must
    neither stall the event loop nor keep the interpreter alive at exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            value = fn()
        except BaseException as e:  # handed to the awaiting task, which decides
            loop.call_soon_threadsafe(settle, False, e)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=run, name="skyline-engine-start", daemon=True).start()
    return await fut


class EngineSupervisor:
    """Starts the engine core (blocking, in the constructor), then keeps it running once
    `start` is called from the event loop. Callbacks run on the event loop:
    `on_message(msg)` for each message of the live engine, `on_death(reason)` when it dies (fail
    what was in flight), `on_restart()` once a new one serves, `on_fatal(reason)` when the
    restart limit is reached."""

    def __init__(self, args: Any, startup_timeout: float | None, policy: RestartPolicy,
                 on_message: Callable[[list[Any]], None],
                 on_death: Callable[[str], None],
                 on_restart: Callable[[], None] = lambda: None,
                 on_fatal: Callable[[str], None] = lambda reason: None) -> None:
        self.args, self.startup_timeout, self.policy = args, startup_timeout, policy
        self.on_message, self.on_death = on_message, on_death
        self.on_restart, self.on_fatal = on_restart, on_fatal
        self._dir = tempfile.mkdtemp(prefix="skyline-")
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self.dead: str | None = None  # why the engine cannot serve now; None while it can
        self.failed = False  # the restart limit was reached: no engine will come back
        self.num_restarts = 0
        self.restarting = False
        self._crashes = RestartWindow(policy)
        self._closed = False
        self._restart_task: asyncio.Task[None] | None = None
        self._pending: _Link | None = None  # the generation being started
        self.link = self._sockets(0)
        try:
            self.link.proc = self._spawn(0)
        except BaseException:
            self._close_all()
            raise
        self.info: dict[str, Any] = self.link.proc.info

    # ------------------------------------------------------------------ public

    @property
    def pid(self) -> int | None:
        proc = self.link.proc
        return proc.proc.pid if proc is not None else None

    def start(self) -> None:
        """Begin reading the engine's outputs (needs a running event loop). Idempotent."""
        if not self.link.watched and not self.link.down and not self._closed:
            self._watch(self.link)

    def send(self, msg: Any) -> None:
        """Send to the engine without ever blocking the event loop; raise EngineDeadError when
        it is down (a PUSH socket with no peer would block)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        send_nowait(self.link.inp, msg)

    def shutdown(self, timeout: float) -> None:
        """Stop the engine (no restart) and release the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            self.dead = "the server is shutting down"
        with contextlib.suppress(zmq.ZMQError):
            self.link.inp.send(pack(("shutdown",)), zmq.NOBLOCK)
        if self.link.proc is not None:
            self.link.proc.join(timeout)
        if self._restart_task is not None:
            self._restart_task.cancel()
        self._stop_watch(self.link)
        self._close_all()

    # ------------------------------------------------------------------ internals

    def _sockets(self, gen: int) -> _Link:
        inp = self._ctx.socket(zmq.PUSH)
        inp.setsockopt(zmq.SNDHWM, 0)  # sends never wait (unbounded queue)
        inp.bind(f"ipc://{self._dir}/in-{gen}")
        out = self._actx.socket(zmq.PULL)
        out.bind(f"ipc://{self._dir}/out-{gen}")
        return _Link(gen, None, inp, out)

    def _spawn(self, gen: int) -> EngineProcess:
        return EngineProcess(self.args, f"ipc://{self._dir}/in-{gen}",
                             f"ipc://{self._dir}/out-{gen}", self.startup_timeout)

    def _watch(self, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        assert link.proc is not None
        # The sentinel is readable the moment the process exits, however it exits (kill -9).
        loop.add_reader(link.proc.proc.sentinel, self._exited, link)
        link.watched = True
        if link.out is not None:
            link.task = loop.create_task(self._read(link))

    def _stop_watch(self, link: _Link) -> None:
        if link.proc is not None:
            with contextlib.suppress(Exception):  # no loop (or a closed one): nothing to remove
                asyncio.get_running_loop().remove_reader(link.proc.proc.sentinel)
        if link.task is not None and link.task is not asyncio.current_task():
            link.task.cancel()

    async def _read(self, link: _Link) -> None:
        assert link.out is not None
        await read_engine(link.out, self.on_message, lambda reason: self._died(link, reason))

    def _exited(self, link: _Link) -> None:
        assert link.proc is not None
        link.proc.proc.join(1)  # it has exited: this only reaps it, for the exit code
        how = exit_description(link.proc.proc.exitcode)
        self._died(link, f"the engine process exited unexpectedly ({how})")

    def _died(self, link: _Link, reason: str) -> None:
        if link.down or link is not self.link or self._closed:
            return
        link.down = True
        self.dead = failure_message(reason)
        log.error("engine core (pid %s) died: %s", self.pid, reason)
        self._stop_watch(link)
        self.on_death(self.dead)
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(link))

    async def _restart(self, old: _Link) -> None:
        self.restarting = True
        try:
            if old.proc is not None:
                await in_daemon_thread(old.proc.kill)  # reap it (it may still be exiting)
            old.close()
            while not self._closed:
                delay = self._crashes.failed()
                if delay is None:
                    self._give_up()
                    return
                log.warning("restarting the engine core in %.1fs (restart %d of at most %d in "
                            "%.0f minutes)", delay, len(self._crashes), self.policy.max_restarts,
                            self.policy.window_s / 60)
                await asyncio.sleep(delay)
                started = time.monotonic()
                link = self._pending = self._sockets(old.gen + 1)
                try:
                    link.proc = await in_daemon_thread(lambda gen=link.gen: self._spawn(gen))
                except EngineStartError as e:
                    log.error("the engine core failed to restart: %s", e)
                    link.close()
                    old = link
                    continue
                finally:
                    self._pending = None
                if self._closed:
                    link.proc.kill()
                    link.close()
                    return
                self.link, self.info = link, link.proc.info
                self.num_restarts += 1
                self.dead = None
                self._watch(link)
                log.warning("engine core restarted (pid %s) in %.1fs; serving again", self.pid,
                            time.monotonic() - started)
                self.on_restart()
                return
        finally:
            self.restarting = False

    def _give_up(self) -> None:
        self.failed = True
        reason = (f"the engine core failed {len(self._crashes)} times in "
                  f"{self.policy.window_s / 60:.0f} minutes; not restarting it again")
        self.dead = reason + "; the server must be restarted"
        log.error("%s", reason)
        self.on_fatal(reason)

    def _close_all(self) -> None:
        self.link.close()
        if self._pending is not None:
            self._pending.close()
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
