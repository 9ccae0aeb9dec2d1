"""The router's /metrics (Prometheus): per replica, requests routed, retries, streams cut,
health, requests open, its load and index size, and prefix-cache hits as the router predicted
them and as the replicas reported them (usage.prompt_tokens_details.cached_tokens).
Everything is read from the replicas' counters at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from skyline.router.fleet import Fleet
from skyline.router.replica import Replica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "skyline_router:"

# name, help, kind, value of a replica
_PER_REPLICA: list[tuple[str, str, str, Callable[[Replica], float]]] = [
    ("requests", "Requests routed to the replica", "counter", lambda r: r.routed),
    ("retries", "Requests that failed to start on the replica and were tried elsewhere",
     "counter", lambda r: r.retries),
    ("failed_streams", "Streams cut by the replica's failure (ended with an error event)",
     "counter", lambda r: r.failed_streams),
    ("replica_healthy", "1 if the replica takes requests", "gauge", lambda r: int(r.healthy)),
    ("replica_in_flight", "Requests the router has open on the replica", "gauge",
     lambda r: r.in_flight),
    ("replica_num_running", "Requests running (its KV events)", "gauge",
     lambda r: r.load.get("num_running", 0)),
    ("replica_num_waiting", "Requests waiting (its KV events)", "gauge", lambda r: r.waiting),
    ("replica_kv_usage", "Fraction of its KV blocks held by requests (its KV events)", "gauge",
     lambda r: r.kv_usage),
    ("prompt_tokens", "Prompt tokens routed (as the router counts them)", "counter",
     lambda r: r.prompt_tokens),
    ("predicted_hit_tokens", "Prompt tokens the router expected the replica to have cached",
     "counter", lambda r: r.predicted_hit_tokens),
    ("usage_prompt_tokens", "Prompt tokens in the replica's usage reports", "counter",
     lambda r: r.usage_prompt_tokens),
    ("usage_cached_tokens", "Cached prompt tokens in the replica's usage reports", "counter",
     lambda r: r.usage_cached_tokens),
    ("pd_prefills", "Prefill halves of disaggregated requests sent to the replica", "counter",
     lambda r: r.pd_prefills),
    ("pd_fallbacks", "Prefill halves that failed (the decode replica prefilled)", "counter",
     lambda r: r.pd_fallbacks),
]


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet, num_no_replica: Callable[[], int]) -> None:
        self.fleet = fleet
        self.num_no_replica = num_no_replica

    def collect(self) -> Iterator[Metric]:
        replicas = self.fleet.replicas
        for name, doc, kind, value in _PER_REPLICA:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = family(PREFIX + name, doc, labels=["replica"])
            for r in replicas:
                m.add_metric([r.name], float(value(r)))
            yield m
        subs = self.fleet.subscribers
        for name, doc, attr in (("kv_event_batches", "KV event batches applied", "num_batches"),
                                ("kv_resyncs", "Snapshots taken (start, gaps, restarts)",
                                 "num_resyncs")):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["replica"])
            for r in replicas:
                sub = subs.get(r.index)
                c.add_metric([r.name], float(getattr(sub, attr) if sub is not None else 0))
            yield c
        g = GaugeMetricFamily(PREFIX + "index_hashes", "Block hashes the index holds for the "
                              "replica", labels=["replica"])
        for r in replicas:
            g.add_metric([r.name], float(self.fleet.index.num_hashes(r.index)))
        yield g
        for name, doc, num, den in (
            ("predicted_hit_rate", "Predicted cached fraction of routed prompt tokens",
             sum(r.predicted_hit_tokens for r in replicas), sum(r.prompt_tokens for r in replicas)),
            ("hit_rate", "Cached fraction of prompt tokens, from the replicas' usage reports",
             sum(r.usage_cached_tokens for r in replicas),
             sum(r.usage_prompt_tokens for r in replicas)),
        ):
            yield GaugeMetricFamily(PREFIX + name, doc, value=num / den if den else 0.0)
        yield CounterMetricFamily(PREFIX + "no_replica", "Requests refused: no replica could "
                                  "take them", value=float(self.num_no_replica()))
        hasher = self.fleet.hasher
        yield GaugeMetricFamily(PREFIX + "prompt_hashing_ready", "1 once prompts are hashed "
                                "for cache-aware routing (the tokenizer has loaded)",
                                value=float(hasher is not None and hasher.ready))


def render(fleet: Fleet, num_no_replica: Callable[[], int]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_FleetCollector(fleet, num_no_replica))
    return generate_latest(registry)
