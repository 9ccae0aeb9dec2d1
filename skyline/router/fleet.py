"""The router's view of its replicas: health, what each is (its GET /fleet), which prefixes
each holds (KV events -> PrefixIndex), and the choice of one for a request.

Health: every `health_interval_s` each replica's GET /health is asked. A replica that fails
it (or a request: a refused connection, a reset before any answer) is down: it gets no
requests, and its index entry is dropped (a restarted engine has an empty cache). One that
answers again rejoins: its GET /fleet is read again and its KV events followed from a
snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import aiohttp
import zmq.asyncio

from skyline.config import RouterConfig
from skyline.router.events import EventSubscriber
from skyline.router.index import PrefixIndex
from skyline.router.policy import Choice, Policy
from skyline.router.replica import Replica, normalize_url

log = logging.getLogger("skyline.router")

APPROX_CAP = 100_000  # hashes remembered for a replica without KV events, at most


class PromptHasher(Protocol):
    """Chained block hashes of a prompt as the replicas compute them (the same tokenizer and
    chat template; engine/frontend/prompt_hash.py). Returns (prompt tokens, hashes), or None
    where the prompt cannot be read (the replica will say why). Until `ready` (`load` ran),
    requests are routed without hashes."""

    ready: bool

    def load(self) -> None: ...

    def chat(self, body: dict[str, Any], block_size: int) -> tuple[int, list[bytes]] | None: ...

    def completion(self, body: dict[str, Any],
                   block_size: int) -> tuple[int, list[bytes]] | None: ...


class Fleet:
    """`discover`, if given, is asked (in a thread) at every health check for the replicas'
    URLs now (a Ray deployment's, which scales and restarts them): new ones join, gone ones
    leave."""

    def __init__(self, cfg: RouterConfig, hasher: PromptHasher | None = None,
                 discover: Callable[[], list[str]] | None = None) -> None:
        self.cfg = cfg
        self.hasher = hasher
        self.discover = discover
        self.replicas = [Replica(i, normalize_url(u)) for i, u in enumerate(cfg.replicas)]
        self._next_index = len(self.replicas)
        self.index = PrefixIndex()
        self.policy = Policy(cfg.policy, cfg.balance_abs, cfg.balance_rel)
        self.session: aiohttp.ClientSession | None = None
        self.zmq = zmq.asyncio.Context()
        self.subscribers: dict[int, EventSubscriber] = {}
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self._health: asyncio.Task[None] | None = None
        self._loading: asyncio.Task[None] | None = None
        self._checking: dict[int, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        self.session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60))
        loop = asyncio.get_running_loop()
        if self.hasher is not None and not self.hasher.ready:
            self._loading = loop.create_task(asyncio.to_thread(self.hasher.load))
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        self._health = loop.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        for sub in list(self.subscribers.values()):
            await sub.close()
        self.subscribers.clear()
        if self.session is not None:
            await self.session.close()
        self.zmq.term()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            if self.discover is not None:
                try:
                    await self.set_replicas(await asyncio.to_thread(self.discover))
                except Exception:  # keep routing over the replicas known
                    log.exception("replica discovery failed")
            await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def set_replicas(self, urls: list[str]) -> None:
        """Follow a new list of replicas: new URLs are added (and checked at once), replicas
        not in it are dropped (their open requests finish)."""
        wanted = {normalize_url(u) for u in urls}
        for r in [r for r in self.replicas if r.url not in wanted]:
            self.mark_down(r, "removed from the fleet")
            self.replicas.remove(r)
            log.info("replica %s left the fleet", r.name)
        known = {r.url for r in self.replicas}
        fresh = [Replica(self._next_index + i, u) for i, u in enumerate(sorted(wanted - known))]
        self._next_index += len(fresh)
        self.replicas += fresh
        await asyncio.gather(*(self.check(r) for r in fresh))

    # ------------------------------------------------------------------ health

    async def check(self, r: Replica) -> None:
        """Ask the replica's /health; (re)join or mark it down."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            async with self.session.get(f"{r.url}/health", headers=self.headers,
                                        timeout=timeout) as resp:
                ok, why = resp.status == 200, f"/health answered {resp.status}"
            if ok and not r.healthy:
                await self.join(r)
            elif not ok:
                self.mark_down(r, why)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as e:
            self.mark_down(r, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    async def join(self, r: Replica) -> None:
        """Read what the replica is and follow its KV events."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        async with self.session.get(f"{r.url}/fleet", headers=self.headers,
                                    timeout=timeout) as resp:
            info: dict[str, Any] = await resp.json() if resp.status == 200 else {}
        r.role = str(info.get("role") or "both")
        r.block_size = info.get("block_size")
        r.num_blocks = info.get("num_blocks")
        r.kv_events_port = info.get("kv_events_port")
        r.kv_transfer_port = info.get("kv_transfer_port")
        await self._unfollow(r)
        if r.kv_events_port is not None:
            sub = EventSubscriber(self.zmq, r, self.index)
            self.subscribers[r.index] = sub
            sub.start()
        r.healthy, r.down_reason = True, ""
        log.info("replica %s joined (%s, block size %s, KV events %s)", r.name, r.role,
                 r.block_size, "on" if r.kv_events_port is not None else "off")

    def mark_down(self, r: Replica, reason: str) -> None:
        if r.healthy:
            log.warning("replica %s is down: %s", r.name, reason)
        r.healthy, r.down_reason = False, reason
        r.load = {}
        self.index.clear(r.index)
        sub = self.subscribers.pop(r.index, None)
        if sub is not None:
            asyncio.get_running_loop().create_task(sub.close())

    def suspect(self, r: Replica, reason: str) -> None:
        """A request failed on `r`: down now, and checked again at once (it rejoins as soon as
        it answers /health)."""
        self.mark_down(r, reason)
        if r.index not in self._checking:
            task = asyncio.get_running_loop().create_task(self.check(r))
            self._checking[r.index] = task
            task.add_done_callback(lambda _: self._checking.pop(r.index, None))

    async def _unfollow(self, r: Replica) -> None:
        sub = self.subscribers.pop(r.index, None)
        if sub is not None:
            await sub.close()

    # ------------------------------------------------------------------ routing

    def healthy(self, roles: Iterable[str] | None = None) -> list[Replica]:
        roles = tuple(roles) if roles is not None else None
        return [r for r in self.replicas if r.healthy and (roles is None or r.role in roles)]

    async def prompt_hashes(self, kind: str, body: dict[str, Any] | None,
                            block_size: int | None) -> tuple[int, list[bytes]]:
        """(prompt tokens, block hashes) of a request, off the event loop; (0, []) when the
        prompt cannot be read here (or not yet: the tokenizer is loading)."""
        if self.hasher is None or not self.hasher.ready or body is None or block_size is None:
            return 0, []
        fn = self.hasher.chat if kind == "chat" else self.hasher.completion
        with contextlib.suppress(Exception):  # the replica gives the client the reason
            got = await asyncio.to_thread(fn, body, block_size)
            if got is not None:
                return got
        return 0, []

    def block_size(self) -> int | None:
        sizes = {r.block_size for r in self.replicas if r.healthy and r.block_size}
        return sizes.pop() if len(sizes) == 1 else None

    def route(self, hashes: list[bytes], candidates: list[Replica]) -> Choice:
        """The policy's pick among `candidates` (non-empty) for a prompt of `hashes`."""
        hits = (self.index.match(hashes, [r.index for r in candidates])
                if hashes and self.policy.uses_cache else {})
        choice = self.policy.choose(candidates, hits)
        r = choice.replica
        if hashes and r.kv_events_port is None and self.policy.uses_cache:
            # No events from it: remember what we sent (the engine caches it once it runs).
            self.index.store(r.index, hashes, cap=r.num_blocks or APPROX_CAP)
        return choice
