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


def free_port(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port free now and not in `taken` (ports handed out already but not bound yet)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p not in taken:
            return p
    raise OSError("no free port found")


def free_port_pair(host: str = "127.0.0.1", taken: frozenset[int] = frozenset()) -> int:
    """A port p with p + 1 also free (KV events and their snapshots), neither in `taken`."""
    for _ in range(100):
        p = free_port(host, taken)
        if p + 1 >= 65535 or p + 1 in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, p + 1))
            except OSError:
                continue
        return p
    raise OSError("no two consecutive free ports found for KV events")


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
        taken = set(reserved)
        for i, argv in enumerate(argvs):
            log_path = os.path.join(log_dir, f"replica-{i}.log") if log_dir else None
            port = free_port(host, frozenset(taken))
            taken.add(port)
            events = free_port_pair(host, frozenset(taken))
            taken.update((events, events + 1))
            self.replicas.append(ReplicaProcess(i, argv, host, port, events, log_path))
        self.sequential = sequential
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

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
