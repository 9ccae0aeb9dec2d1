"""One replica as the router sees it: where it is, what it does, how loaded and healthy it is,
and what the router sent it."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Replica:
    index: int
    url: str  # scheme://host:port, no trailing slash or /v1
    healthy: bool = False
    down_reason: str = "not checked yet"
    # From its GET /fleet when it (re)joins
    role: str = "both"  # both | prefill | decode
    block_size: int | None = None
    num_blocks: int | None = None
    kv_events_port: int | None = None
    kv_transfer_port: int | None = None  # a prefill replica's: decode replicas pull KV there
    # From its KV events: num_running, num_waiting, kv_usage
    load: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0  # requests the router has open on it now
    # Counters (the router's /metrics)
    routed: int = 0
    retries: int = 0  # requests that failed to start here and went elsewhere
    failed_streams: int = 0  # streams cut by the replica's failure
    prompt_tokens: int = 0  # of requests routed here (router's count)
    predicted_hit_tokens: int = 0
    usage_prompt_tokens: int = 0  # from responses' usage
    usage_cached_tokens: int = 0
    pd_prefills: int = 0  # prefill halves of disaggregated requests (a prefill replica)
    pd_fallbacks: int = 0  # of which failed: the decode replica prefilled the prompt itself

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def name(self) -> str:
        return urlsplit(self.url).netloc

    @property
    def waiting(self) -> float:
        return self.load.get("num_waiting", 0.0)

    @property
    def kv_usage(self) -> float:
        return self.load.get("kv_usage", 0.0)


def normalize_url(url: str) -> str:
    """'127.0.0.1:8001' or 'http://h:8001/v1/' -> 'http://h:8001'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"a replica is given as http://HOST:PORT, got {url!r}")
    return url
