"""Prefill/decode disaggregation in the router (the engines' side: cache/pd.py and
worker/connector/pd.py).

A chat or completion request, while the fleet has a healthy prefill replica:
1. the policy picks a decode replica (role decode or both) as for any request; if the prompt
   tokens it does not hold cached are fewer than `pd_min_prompt_tokens` (a short prompt, or
   a prefix hit there), the request simply goes there and is prefilled where it decodes;
2. otherwise the policy picks a prefill replica, which gets the request with one output
   token, no stream, and kv_transfer_params {transfer_id, do_remote_decode}: it computes the
   prompt's KV and keeps its blocks for the transfer;
3. the decode replica then gets the client's request unchanged but for kv_transfer_params
   {transfer_id, peer}: it pulls the prompt's KV from the prefill replica while it decodes
   others, computes the last prompt token, and streams the answer: the client sees one
   stream, the decode replica's, with its usage.
A prefill that fails (an error, a dead replica) or a transfer that fails falls back to local
prefill on the decode replica; its answer is the same.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from skyline.router.fleet import Fleet
from skyline.router.proxy import NotStarted, Proxy, Routed
from skyline.router.replica import Replica

log = logging.getLogger("skyline.router")

DECODE_ROLES = ("decode", "both")
# Fields of the client's request the prefill half does without: it returns one token, whole.
_DROP = ("stream_options", "logprobs", "top_logprobs", "max_completion_tokens", "echo")


class Disaggregated:
    def __init__(self, fleet: Fleet, proxy: Proxy) -> None:
        self.fleet = fleet
        self.proxy = proxy

    async def __call__(self, request: Request, routed: Routed) -> Response:
        path = request.url.path
        fleet = self.fleet
        decoders = fleet.healthy(DECODE_ROLES)
        prefillers = [r for r in fleet.healthy(("prefill",)) if r.kv_transfer_port]
        body = routed.parsed
        if not decoders or not prefillers or body is None or not routed.num_prompt_tokens:
            return await self.proxy.forward(request, path, routed, DECODE_ROLES)
        choice = fleet.route(list(routed.hashes), decoders)
        d = choice.replica
        uncached = routed.num_prompt_tokens - choice.hit_blocks * (d.block_size or 0)
        if uncached < fleet.cfg.pd_min_prompt_tokens or body.get("n", 1) != 1:
            return await self.proxy.forward(request, path, routed, DECODE_ROLES)
        p = fleet.route(list(routed.hashes), prefillers).replica
        tid = uuid.uuid4().hex
        headers = self.proxy.forward_headers(request)
        prefilled = await self.prefill(p, path, body, tid, headers)
        if prefilled:
            body = {**body, "kv_transfer_params": {
                "transfer_id": tid, "peer": f"tcp://{_host(p)}:{p.kv_transfer_port}"}}
        decode = Routed(routed.kind, json.dumps(body).encode(), body, routed.num_prompt_tokens,
                        routed.hashes)
        try:
            out = await self.proxy.attempt(d, request, path, decode, headers)
        except NotStarted as e:
            d.retries += 1
            log.info("the decode half did not start on %s (%s); prefilling elsewhere", d.name, e)
            return await self.proxy.forward(request, path, routed, DECODE_ROLES)
        self.proxy.count(d, routed, choice.hit_blocks)
        return out

    async def prefill(self, p: Replica, path: str, body: dict[str, Any], tid: str,
                      headers: dict[str, str]) -> bool:
        """The prefill half on `p`; False if it failed (the decode replica then prefills)."""
        assert self.fleet.session is not None
        half = {k: v for k, v in body.items() if k not in _DROP}
        half.update(stream=False, max_tokens=1, min_tokens=0, n=1,
                    kv_transfer_params={"transfer_id": tid, "do_remote_decode": True})
        p.in_flight += 1
        p.pd_prefills += 1
        try:
            async with self.fleet.session.post(f"{p.url}{path}", json=half,
                                               headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
                why = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            why = f"{type(e).__name__}"
            self.fleet.suspect(p, f"{why} in a prefill")
        finally:
            p.in_flight -= 1
        p.pd_fallbacks += 1
        log.info("prefill on %s failed (%s); the decode replica prefills", p.name, why)
        return False


def _host(r: Replica) -> str:
    return f"[{r.host}]" if ":" in r.host else r.host
