"""A fleet on Ray Serve: replicas and the router as Serve deployments, placed by Ray with their
devices, scaled by Serve and restarted by it when they fail.

- Replicas: one Serve deployment per role ("skyline-both", or "skyline-prefill" and
  "skyline-decode"), `num_replicas` each, `ray_actor_options` giving each replica its GPUs
  (Ray sets CUDA_VISIBLE_DEVICES) and CPUs. A replica starts a plain `skyline serve` on its
  node (with KV events on) and heartbeats its URL to a registry actor; Serve's health check
  (`check_health`) fails when that server is gone or unhealthy, and Serve replaces the
  replica.
- Router: a Serve deployment of one replica that runs `skyline router`'s app on `port` with
  its own HTTP server (requests do not go through Serve's proxy, which is off: no extra hop
  per token). Its fleet follows the registry: scaled, restarted and failed replicas join and
  leave as the registry sees their heartbeats come and stop.

    from skyline.deploy.ray import RayFleet
    fleet = RayFleet.deploy(["--model", "m.gguf"], num_replicas=2, port=8000)
    fleet.scale(4)
    fleet.shutdown()

`skyline serve --ray --replicas N` does the same from the command line. Ray is an optional
dependency (`pip install 'skyline[fleet]'`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from skyline.config import ConfigError, RouterConfig
from skyline.router.launch import ReplicaProcess, free_port, free_port_pair

log = logging.getLogger("skyline.deploy")

REGISTRY = "skyline-fleet-registry"
NAMESPACE = "skyline"
HEARTBEAT_S = 2.0
STALE_S = 10.0  # a replica that has not heartbeat for this long is out of the fleet
STARTUP_TIMEOUT_S = 900.0


def _ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError:
        raise ConfigError("--ray needs Ray Serve: pip install 'skyline[fleet]' (ray[serve])"
                          ) from None
    return ray


class Registry:
    """Replica URLs by last heartbeat (a named Ray actor)."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def heartbeat(self, url: str) -> None:
        self.seen[url] = time.monotonic()

    def remove(self, url: str) -> None:
        self.seen.pop(url, None)

    def urls(self) -> list[str]:
        now = time.monotonic()
        self.seen = {u: t for u, t in self.seen.items() if now - t < STALE_S}
        return sorted(self.seen)


class ReplicaServer:
    """A Serve replica: a `skyline serve` child on this node, heartbeating its URL. `host`:
    the address it listens on (None: the node's, for a cluster of several machines)."""

    def __init__(self, argv: list[str], host: str | None) -> None:
        ray = _ray()
        host = host or ray.util.get_node_ip_address()
        port = free_port(host)
        self.server = ReplicaProcess(0, argv, host, port, free_port_pair(host, frozenset({port})))
        self.server.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.healthy():
            assert self.server.proc is not None
            if self.server.proc.poll() is not None or time.monotonic() > deadline:
                self.server.stop(5)
                raise RuntimeError(f"skyline serve {' '.join(argv)} did not start")
            time.sleep(0.5)
        self.registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            if self.server.proc is not None and self.server.proc.poll() is None:
                self.registry.heartbeat.remote(self.server.url)
            self._stop.wait(HEARTBEAT_S)

    def url(self) -> str:
        return self.server.url

    def check_health(self) -> None:
        """Serve's health check: failing it gets this replica replaced."""
        assert self.server.proc is not None
        if self.server.proc.poll() is not None:
            raise RuntimeError(f"the replica's server exited ({self.server.proc.returncode})")
        if not self.server.healthy():
            raise RuntimeError("the replica's server does not answer /health")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.registry.remove.remote(self.server.url)
        if getattr(self, "server", None) is not None:
            self.server.stop(30)


class RouterServer:
    """A Serve replica running the router's HTTP server on `port` (in a thread)."""

    def __init__(self, cfg: RouterConfig, model: str | None, host: str, port: int) -> None:
        import uvicorn

        from skyline.engine.frontend.prompt_hash import PromptHasher
        from skyline.router.app import build_app
        from skyline.router.fleet import Fleet

        ray = _ray()
        registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        fleet = Fleet(cfg, PromptHasher(model),
                      discover=lambda: ray.get(registry.urls.remote(), timeout=10))
        config = uvicorn.Config(build_app(fleet), host=host, port=port, log_level="warning",
                                access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)
        self.thread.start()

    def check_health(self) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the router's HTTP server stopped")

    def __del__(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.should_exit = True
            self.thread.join(30)


@dataclass
class RayFleet:
    """A deployed fleet: its replica deployments (role -> count) and where the router is."""

    argv: list[str]
    roles: dict[str, int]
    url: str
    actor_options: dict[str, Any] = field(default_factory=dict)
    replica_host: str | None = None

    @classmethod
    def deploy(cls, argv: list[str], num_replicas: int = 2, *, roles: dict[str, int] | None
               = None, cfg: RouterConfig | None = None, model: str | None = None,
               host: str = "127.0.0.1", port: int = 8000, num_gpus: float = 0.0,
               num_cpus: float = 1.0, address: str | None = None,
               ray_init: dict[str, Any] | None = None,
               timeout: float = STARTUP_TIMEOUT_S) -> RayFleet:
        """Deploy `num_replicas` replicas of `skyline serve ARGV` (or `roles`: role -> count)
        and a router on host:port; returns once every replica has joined."""
        ray = _ray()
        from ray import serve

        roles = roles or {"both": num_replicas}
        # A cluster started here stays on the loopback interface; one joined is reached at
        # its nodes' addresses.
        local = address is None
        if not ray.is_initialized():
            extra = {"_node_ip_address": "127.0.0.1"} if local else {}
            ray.init(address=address, namespace=NAMESPACE, **extra, **(ray_init or {}))
        Registry_ = ray.remote(num_cpus=0)(Registry)
        Registry_.options(name=REGISTRY, namespace=NAMESPACE, get_if_exists=True,
                          lifetime="detached").remote()
        serve.start(proxy_location="Disabled")
        fleet = cls(argv, dict(roles), f"http://{host}:{port}",
                    {"num_gpus": num_gpus, "num_cpus": num_cpus},
                    "127.0.0.1" if local else None)
        for role, n in roles.items():
            fleet._deploy_role(role, n)
        registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        deadline = time.monotonic() + timeout
        while len(urls := ray.get(registry.urls.remote())) < sum(roles.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not all start in time")
            time.sleep(0.5)
        cfg = replace(cfg or RouterConfig(replicas=("-",)), replicas=tuple(urls))
        router = serve.deployment(RouterServer, name="skyline-router", num_replicas=1,
                                  ray_actor_options={"num_cpus": 0},
                                  health_check_period_s=5)
        serve.run(router.bind(cfg, model, host, port), name="skyline-router",
                  route_prefix=None, blocking=False)
        _wait_http(f"{fleet.url}/health", deadline)
        return fleet

    def _deploy_role(self, role: str, n: int) -> None:
        from ray import serve

        dep = serve.deployment(ReplicaServer, name=f"skyline-{role}", num_replicas=n,
                               ray_actor_options=self.actor_options, health_check_period_s=5,
                               health_check_timeout_s=30, graceful_shutdown_timeout_s=30)
        serve.run(dep.bind([*self.argv, "--role", role], self.replica_host),
                  name=f"skyline-{role}",
                  route_prefix=None, blocking=False)

    def scale(self, n: int, role: str = "both") -> None:
        """Run `n` replicas of `role` (Serve adds or drains replicas; the router follows)."""
        if n < 0:
            raise ValueError("a fleet cannot have fewer than 0 replicas")
        self.roles[role] = n
        if n == 0:
            from ray import serve

            serve.delete(f"skyline-{role}")
        else:
            self._deploy_role(role, n)

    def shutdown(self) -> None:
        ray = _ray()
        from ray import serve

        serve.shutdown()
        try:
            ray.kill(ray.get_actor(REGISTRY, namespace=NAMESPACE))
        except ValueError:
            pass


def _wait_http(url: str, deadline: float) -> None:
    import urllib.request

    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in time")
        time.sleep(0.5)


def deploy_from_cli(argv: list[str], roles: dict[str, int], cfg: RouterConfig,
                    model: str | None, host: str, port: int, num_gpus: float, num_cpus: float,
                    address: str | None, wait: Callable[[], None]) -> None:
    """`skyline serve --ray`: deploy, serve until `wait` returns (Ctrl-C / SIGTERM), remove."""
    fleet = RayFleet.deploy(argv, roles=roles, cfg=cfg, model=model, host=host, port=port,
                            num_gpus=num_gpus, num_cpus=num_cpus, address=address)
    print(f"skyline: fleet on Ray Serve at {fleet.url}/v1 ({roles})", flush=True)
    try:
        wait()
    finally:
        fleet.shutdown()
