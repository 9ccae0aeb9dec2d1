"""`skyline serve --replicas N`: N `skyline serve` processes on this host, each on its own
port with its KV events on, kept running (a replica that exits is started again, with
backoff), and stopped with the router.

Each replica is a plain `skyline serve` child process given its own flags (port, device,
threads, memory share, role), so a replica here is exactly what a remote one would be, and
the router treats both alike.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("skyline.router")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
MAX_RESTARTS = 5  # within RESTART_WINDOW_S; beyond, the replica stays down
RESTART_WINDOW_S = 600.0
MAX_PORT_MOVES = 3  # new ports for a replica whose own were taken during its start-up
EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default ip_local_port_range
MIN_PORT = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes ports from for outgoing connections and bind(0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def _offer(host: str) -> int:
    """A port to try. A replica binds its ports only once its model is loaded, seconds to
    minutes after they are chosen: a port from the ephemeral range may meanwhile be given to any
    process's outgoing connection, so ports come from outside it (at random), or from the
    kernel where that range leaves too few."""
    low, high = ephemeral_ports()
    spans = [(a, b) for a, b in ((MIN_PORT, low), (high + 1, 65535)) if b - a >= 1000]
    if not spans:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    a, b = random.choice(spans)
    return random.randrange(a, b)


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind `port` now (with SO_REUSEADDR, as uvicorn and ZMQ do: a port
    held only by closed connections is free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset(),
              span: int = 1) -> int:
    """A port p with p .. p + span - 1 free now and none in `taken` (ports handed out already
    but not bound yet)."""
    for _ in range(200):
        p = _offer(host)
        ports = range(p, p + span)
        if p + span <= 65535 and not taken.intersection(ports) and all(
                port_free(host, q) for q in ports):
            return p
    raise OSError(f"no {span} consecutive free port(s) found on {host}")


def free_port_pair(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port p with p + 1 also free (KV events and their snapshots), neither in `taken`."""
    return free_port(host, taken, span=2)


@functools.cache
def _prctl() -> Any:
    """libc's prctl, loaded in the parent: a child between fork and exec must not load a
    library (another thread may have held the loader's lock at the fork)."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, however it dies (Linux; the
    replicas are in their own session, out of reach of the terminal's Ctrl-C, so that the
    launcher can stop them in order)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class ReplicaProcess:
    """One child `skyline serve` and its fixed ports (kept across restarts)."""

    index: int
    argv: list[str]  # `skyline serve` arguments (no --port / --kv-events-port)
    host: str
    port: int
    kv_events_port: int
    log_path: str | None = None
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    port_moves: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "skyline.cli", "serve", *self.argv, "--host", self.host,
                "--port", str(self.port), "--kv-events-port", str(self.kv_events_port)]

    def start(self) -> None:
        _prctl()
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, timeout: float) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class LocalReplicas:
    """Starts the replicas, restarts those that exit, stops them all on `stop`."""

    def __init__(self, argvs: list[list[str]], host: str = "127.0.0.1",
                 log_dir: str | None = None, sequential: bool = False,
                 reserved: tuple[int, ...] = ()) -> None:
        self.replicas = []
        # Each port is bound by its replica only once that replica starts: none may be handed
        # out twice, nor be one the caller holds (the router's, bound before the replicas).
        self._taken = set(reserved)
        for i, argv in enumerate(argvs):
            log_path = os.path.join(log_dir, f"replica-{i}.log") if log_dir else None
            port, events = self._new_ports(host)
            self.replicas.append(ReplicaProcess(i, argv, host, port, events, log_path))
        self.sequential = sequential
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def _new_ports(self, host: str) -> tuple[int, int]:
        port = free_port(host, frozenset(self._taken))
        self._taken.add(port)
        events = free_port_pair(host, frozenset(self._taken))
        self._taken.update((events, events + 1))
        return port, events

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self, timeout: float = 900.0) -> None:
        """Start every replica and wait until all answer /health (one after the other when
        `sequential`: replicas sharing a GPU each size their KV cache from what the earlier
        ones left). Raises RuntimeError with the log's tail if one exits or times out."""
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            r.start()
            if self.sequential:
                self._wait_healthy([r], deadline)
        self._wait_healthy(self.replicas, deadline)
        self._watch = threading.Thread(target=self._keep_running, name="replicas", daemon=True)
        self._watch.start()

    def _wait_healthy(self, replicas: list[ReplicaProcess], deadline: float) -> None:
        pending = list(replicas)
        while pending:
            for r in list(pending):
                assert r.proc is not None
                if r.proc.poll() is not None:
                    if self._move_if_taken(r):
                        continue
                    self.stop()
                    raise RuntimeError(f"replica {r.index} exited during start-up (code "
                                       f"{r.proc.returncode}){self._tail(r)}")
                if r.healthy():
                    pending.remove(r)
            if pending and time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"replica {pending[0].index} did not start in time"
                                   f"{self._tail(pending[0])}")
            time.sleep(0.5)

    def _move_if_taken(self, r: ReplicaProcess) -> bool:
        """A replica that exited during start-up because another process took one of its ports
        (free when chosen) starts again on new ones, at most MAX_PORT_MOVES times."""
        ports = (r.port, r.kv_events_port, r.kv_events_port + 1)
        if r.port_moves >= MAX_PORT_MOVES or all(port_free(r.host, p) for p in ports):
            return False
        r.port_moves += 1
        r.port, r.kv_events_port = self._new_ports(r.host)
        log.warning("replica %d exited during start-up: one of its ports %s was taken by another "
                    "process; starting it again on %d (KV events %d)", r.index, ports, r.port,
                    r.kv_events_port)
        r.start()
        return True

    @staticmethod
    def _tail(r: ReplicaProcess) -> str:
        if not r.log_path or not os.path.exists(r.log_path):
            return ""
        with open(r.log_path, errors="replace") as f:
            return ":\n" + "".join(f.readlines()[-20:])

    def _keep_running(self) -> None:
        while not self._stopping.wait(1.0):
            for r in self.replicas:
                if r.proc is None or r.proc.poll() is None:
                    continue
                now = time.monotonic()
                r.restarts = [t for t in r.restarts if now - t < RESTART_WINDOW_S]
                if len(r.restarts) >= MAX_RESTARTS:
                    continue
                delay = min(BACKOFF_FIRST_S * 2 ** len(r.restarts), BACKOFF_MAX_S)
                log.warning("replica %d exited (code %s); starting it again in %.0f s",
                            r.index, r.proc.returncode, delay)
                if self._stopping.wait(delay):
                    return
                r.restarts.append(time.monotonic())
                r.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every replica (SIGTERM, then SIGKILL after `timeout`). Idempotent."""
        self._stopping.set()
        threads = [threading.Thread(target=r.stop, args=(timeout,)) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
