"""`skyline serve --replicas N`'s launcher: the ports it hands out, and a replica whose port
another process took while it started."""

from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from skyline.router import launch
from skyline.router.launch import LocalReplicas

# A replica in miniature: binds its HTTP port and its two KV-event ports as a real one does
# (SO_REUSEADDR), exits 1 when one is taken, answers /health otherwise.
FAKE_REPLICA = textwrap.dedent("""
    import http.server, socket, sys
    port, events = int(sys.argv[1]), int(sys.argv[2])
    held = []
    for p in (events, events + 1):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", p))
        held.append(s)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def test_replica_ports_are_distinct_and_avoid_the_routers(monkeypatch: pytest.MonkeyPatch):
    """A port may be offered again before anything binds it: the launcher hands out none twice
    and never the router's (held, bound, while the replicas start)."""
    offers = iter([5000, 5000, 5002, 5002, 5003, 5002, 5006, 5010])
    monkeypatch.setattr(launch, "_offer", lambda host: next(offers))
    monkeypatch.setattr(launch, "port_free", lambda host, port: True)
    local = LocalReplicas([[], []], reserved=(5000,))
    ports = [(r.port, r.kv_events_port) for r in local.replicas]
    # 5000 is the router's; replica 0 takes 5002 and its events 5003-5004, so replica 1
    # is offered 5002 again and takes the next offer
    assert ports == [(5002, 5003), (5006, 5010)]


def test_ports_come_from_outside_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch):
    """The kernel hands ports of its ephemeral range to any process's outgoing connections: a
    replica's port, chosen long before the replica binds it, is taken from outside it."""
    monkeypatch.setattr(launch, "ephemeral_ports", lambda: (32768, 60999))
    for _ in range(50):
        p = launch.free_port_pair()
        assert launch.MIN_PORT <= p and not 32768 <= p <= 60999 and not 32768 <= p + 1 <= 60999
    # a range that leaves too few ports outside it: the kernel's pick
    monkeypatch.setattr(launch, "ephemeral_ports", lambda: (1024, 65000))
    assert 1024 <= launch.free_port() <= 65000


def test_a_replica_whose_port_was_taken_starts_on_new_ones(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(launch.ReplicaProcess, "command", lambda r: [
        sys.executable, "-c", FAKE_REPLICA, str(r.port), str(r.kv_events_port)])
    local = LocalReplicas([[], []])
    squatter = socket.socket()  # another process's connection, on replica 1's event port
    squatter.bind(("127.0.0.1", local.replicas[1].kv_events_port + 1))
    taken = local.replicas[1].port
    try:
        local.start(timeout=60)
        assert local.replicas[1].port != taken and local.replicas[1].port_moves == 1
        assert local.replicas[0].port_moves == 0
        assert all(r.healthy() for r in local.replicas)
        assert local.urls[1] == f"http://127.0.0.1:{local.replicas[1].port}"
    finally:
        local.stop(timeout=5)
        squatter.close()


def test_a_replica_that_fails_for_another_reason_is_not_moved(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(launch.ReplicaProcess, "command", lambda r: [
        sys.executable, "-c", "import sys; print('bad flag'); sys.exit(2)"])
    local = LocalReplicas([[]])
    with pytest.raises(RuntimeError, match=r"replica 0 exited during start-up \(code 2\)"):
        local.start(timeout=60)
    assert local.replicas[0].port_moves == 0
