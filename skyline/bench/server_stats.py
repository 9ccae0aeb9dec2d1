"""The server's own count of prompt tokens it did not compute, read from its /metrics before
and after a load run: prefix-cache hits on the device and, with KV tiers, in host RAM and on
disk (skyline's names; vLLM's `vllm:` names for the device's)."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {
    "prefix_cache_queries": "query_tokens",
    "prefix_cache_hits": "device_hit_tokens",
}


def scrape(base_url: str, api_key: str | None = None, timeout: float = 10.0
           ) -> dict[str, float] | None:
    """The server's prefix-cache counters, or None if it has no /metrics to read."""
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    req = urllib.request.Request(f"{root}/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.split(":", 1)[-1]
        for s in family.samples:
            if name in _COUNTERS and s.name.endswith("_total"):
                out[_COUNTERS[name]] = s.value
            elif name == "kv_offload_hit_tokens" and s.name.endswith("_total"):
                out[f"{s.labels['tier']}_hit_tokens"] = s.value
    return out or None


def cache_delta(before: dict[str, float] | None, after: dict[str, float] | None
                ) -> dict[str, Any] | None:
    """Tokens looked up and found where, during the run, and the hit rates."""
    if not before or not after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    q = d.get("query_tokens", 0.0)
    for k in [k for k in d if k.endswith("_hit_tokens")]:
        d[k.replace("_tokens", "_rate")] = d[k] / q if q else 0.0
    hits = sum(v for k, v in d.items() if k.endswith("_hit_tokens"))
    d["hit_rate"] = hits / q if q else 0.0
    return d


def format_cache(d: dict[str, Any]) -> str:
    lines = [f"{'-' * 14} Server prefix cache {'-' * 14}"]
    lines.append(f"{'Prompt tokens looked up:':<36}{d.get('query_tokens', 0):>16.0f}")
    for where in ("device", "ram", "disk"):
        if f"{where}_hit_tokens" in d:
            lines.append(f"{f'Hit rate, {where}:':<36}{d[f'{where}_hit_rate']:>16.3f}")
    lines.append(f"{'Hit rate, all:':<36}{d['hit_rate']:>16.3f}")
    return "\n".join(lines)
