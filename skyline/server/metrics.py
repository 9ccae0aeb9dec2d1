"""Prometheus metrics under vLLM's names with a `skyline:` prefix (vllm:time_to_first_token_seconds
-> skyline:time_to_first_token_seconds), so existing dashboards need only the prefix changed.

Request latencies are observed here, in the API process, as the client sees them; engine state
(running / waiting, KV usage, prefix-cache counters, preemptions) is read from the engine core's
latest stats at scrape time.

With several API processes (`serve --api-server-count N`), the request metrics are
prometheus_client's multiprocess mode: each process writes its counters and histograms to files
in one directory and every /metrics sums all of them, so a scrape that lands on any process
sees the whole server (series labelled by process would show only the one scraped).
`skyline:api_server_requests_total{api_server="i"}` counts the requests each one took.
"""

from __future__ import annotations

import glob
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from skyline.types import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# per-position and per-bucket keys of sched/spec's stats
_POS_KEY = re.compile(r"spec_acceptance_pos_(\d+)")
_GATE_KEY = re.compile(r"spec_gate_b(\d+)_(spec|plain)_tokens_per_s")
# per-tier keys of the KV tiers' stats (cache/offload.py)
_TIER = r"kv_offload_(ram|disk)_"

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector(Collector):
    """Engine-side gauges and counters, from the stats the engine core last reported."""

    def __init__(self, model: str, stats: Callable[[], dict[str, Any]],
                 restarts: Callable[[], int]) -> None:
        self.model = model
        self.stats = stats
        self.restarts = restarts

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"skyline:{name}", doc, labels=labels)
            g.add_metric([self.model], float(value))
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"skyline:{name}", doc, labels=labels)
            c.add_metric([self.model], float(value))
            return c

        def by_key(name: str, doc: str, key: re.Pattern[str] | str, extra: list[str],
                   family: type = GaugeMetricFamily) -> Metric:
            # one sample per stats key matching `key`, its groups the `extra` label values
            g = family(f"skyline:{name}", doc, labels=[*labels, *extra])
            for k, value in s.items():
                if (m := re.fullmatch(key, k)) is not None:
                    g.add_metric([self.model, *m.groups()], float(value))
            return g

        yield gauge("num_requests_running", "Requests in the running batch.",
                    s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    s.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "KV-cache usage (1 means 100 percent).",
                    s.get("kv_usage", 0.0))
        yield gauge("kv_cache_used_blocks", "KV-cache blocks held by requests (0 when idle: "
                    "more is a leak).", s.get("num_used_blocks", 0))
        yield counter("engine_restarts", "Times the engine core died and was restarted.",
                      self.restarts())
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hit rate over all queried tokens.",
                    s.get("prefix_cache_hit_rate", 0.0))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_query_tokens", 0))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hit_tokens", 0))
        yield counter("num_preemptions", "Preemptions (requests evicted and recomputed).",
                      s.get("num_preemptions", 0))
        if "kv_offload_ram_hit_tokens" in s:  # KV tiers beyond the device
            yield from self._tiers(s, counter, by_key)
        if "pd_loaded_blocks" in s:  # a prefill or decode replica (cache/pd.py)
            for key, doc in (("pd_sent_blocks", "Blocks a decode replica pulled from here."),
                             ("pd_send_expired", "Sends no decode replica pulled in time."),
                             ("pd_loaded_blocks", "Prompt blocks pulled from a prefill replica."),
                             ("pd_load_failed_blocks", "Blocks that failed to arrive "
                                                       "(recomputed here)."),
                             ("pd_loaded_bytes", "KV bytes pulled from prefill replicas."),
                             ("pd_load_seconds", "Seconds from each pull's start to its end.")):
                yield counter(f"kv_transfer_{key[3:]}", doc, s.get(key, 0))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                      s.get("spec_num_draft_tokens", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      s.get("spec_num_accepted_tokens", 0))
        yield gauge("spec_decode_acceptance_rate", "Accepted over verified draft tokens.",
                    s.get("spec_acceptance_rate", 0.0))
        yield gauge("spec_decode_mean_accepted_length",
                    "Tokens emitted per verification (accepted drafts plus one).",
                    s.get("spec_mean_accepted_length", 0.0))
        yield by_key("spec_decode_acceptance_by_position",
                     "Acceptance rate of the draft token at each position (0: the first draft).",
                     _POS_KEY, ["position"])
        yield gauge("spec_decode_speculated_fraction",
                    "Share of measured decode steps that speculated (the speculation gate).",
                    s.get("spec_gate_speculated_fraction", 0.0))
        yield by_key("spec_decode_gate_tokens_per_second",
                     "The speculation gate's measured output tokens/s by batch-size bucket and "
                     "mode.", _GATE_KEY, ["batch", "mode"])


    def _tiers(self, s: dict[str, Any], counter: Callable[..., Metric],
               by_key: Callable[..., Metric]) -> Iterator[Metric]:
        yield counter("external_prefix_cache_queries",
                      "Prompt tokens looked up beyond the device's prefix cache.",
                      s.get("prefix_cache_query_tokens", 0))
        yield counter("external_prefix_cache_hits",
                      "Prompt tokens restored from the KV tiers instead of computed.",
                      s["kv_offload_ram_hit_tokens"] + s.get("kv_offload_disk_hit_tokens", 0))
        tier = ["tier"]
        yield by_key("kv_offload_hit_tokens", "Prompt tokens restored from each KV tier.",
                     _TIER + "hit_tokens", tier, CounterMetricFamily)
        yield by_key("kv_offload_stored_blocks", "Blocks written to each KV tier.",
                     _TIER + "stored_blocks", tier, CounterMetricFamily)
        yield by_key("kv_offload_evicted_blocks", "Blocks evicted from each KV tier.",
                     _TIER + "evicted_blocks", tier, CounterMetricFamily)
        yield by_key("kv_offload_blocks", "Blocks each KV tier holds.", _TIER + "blocks", tier)
        yield by_key("kv_offload_capacity_blocks", "Blocks each KV tier can hold.",
                     _TIER + "capacity_blocks", tier)
        yield by_key("kv_offload_usage_perc", "Each KV tier's usage (1 means 100 percent).",
                     _TIER + "usage", tier)
        yield by_key("kv_offload_failed_blocks",
                     "Blocks a KV tier could not read (recomputed) or write (not kept).",
                     r"kv_offload_(load|store)_failed_blocks", ["op"], CounterMetricFamily)


class Metrics:
    def __init__(self, model: str, engine_stats: Callable[[], dict[str, Any]],
                 engine_restarts: Callable[[], int] = lambda: 0,
                 api_server: int | None = None, multiprocess_dir: str | None = None) -> None:
        """`api_server`: this process's index among several; `multiprocess_dir`: theirs
        (PROMETHEUS_MULTIPROC_DIR, set before prometheus_client was imported)."""
        disable_created_metrics()  # no *_created series, as vLLM
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r, lb = self.registry, ["model_name"]
        self.ttft = Histogram("skyline:time_to_first_token_seconds",
                              "Time to first token.", lb, buckets=_LATENCY, registry=r)
        self.itl = Histogram("skyline:inter_token_latency_seconds",
                             "Time between consecutive output tokens.", lb, buckets=_ITL,
                             registry=r)
        self.e2e = Histogram("skyline:e2e_request_latency_seconds",
                             "End-to-end request latency.", lb, buckets=_LATENCY, registry=r)
        self.queue = Histogram("skyline:request_queue_time_seconds",
                               "Time requests spent waiting before their first step.", lb,
                               buckets=_LATENCY, registry=r)
        self.prompt_len = Histogram("skyline:request_prompt_tokens", "Prompt tokens per request.",
                                    lb, buckets=_TOKENS, registry=r)
        self.gen_len = Histogram("skyline:request_generation_tokens",
                                 "Generated tokens per request.", lb, buckets=_TOKENS,
                                 registry=r)
        self.prompt_tokens = Counter("skyline:prompt_tokens", "Prefill tokens processed.", lb,
                                     registry=r)
        self.gen_tokens = Counter("skyline:generation_tokens", "Generation tokens produced.", lb,
                                  registry=r)
        self.success = Counter("skyline:request_success", "Requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=r)
        # The series of every streamed token, looked up once (a label lookup per token per
        # stream is measurable at hundreds of streams).
        self.itl_series = self.itl.labels(model)
        self.gen_tokens_series = self.gen_tokens.labels(model)
        self.api_server_series = None
        if api_server is not None:
            self.api_server_series = Counter(
                "skyline:api_server_requests", "Requests each API process took.",
                ["model_name", "api_server"], registry=r).labels(model, str(api_server))
        engine = _EngineCollector(model, engine_stats, engine_restarts)
        self.exposed = r  # what /metrics renders
        if multiprocess_dir is not None:
            self.exposed = CollectorRegistry(auto_describe=True)
            _SizedFilesCollector(self.exposed, path=multiprocess_dir)
        self.exposed.register(engine)

    def render(self) -> bytes:
        return generate_latest(self.exposed)

    def tracker(self, num_prompt_tokens: int) -> RequestTracker:
        if self.api_server_series is not None:
            self.api_server_series.inc()
        return RequestTracker(self, num_prompt_tokens)


class _SizedFilesCollector(multiprocess.MultiProcessCollector):
    """prometheus_client's collector of several processes' files, passing over a file another
    API process has created and not yet sized (empty for an instant: reading it raised
    struct.error, which stopped an API process starting beside it, and with it the server)."""

    def collect(self) -> Iterator[Metric]:
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(path) >= 8:  # the used-bytes header, at least
                    files.append(path)
            except OSError:  # gone: its process was marked dead
                pass
        return self.merge(files, accumulate=True)


class RequestTracker:
    """Times one request from arrival, as its outputs stream by."""

    def __init__(self, metrics: Metrics, num_prompt_tokens: int) -> None:
        self.m = metrics
        self.arrival = time.monotonic()
        self.num_prompt_tokens = num_prompt_tokens
        self.first: float | None = None
        self.last: float | None = None
        self.num_generated = 0
        self.queue_time: float | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        new = sum(len(c.token_ids) for c in out.outputs)
        if "queue_time" in out.metrics and self.queue_time is None:
            self.queue_time = out.metrics["queue_time"]
            self.m.queue.labels(self.m.model).observe(self.queue_time)
        if not new:
            return
        now = time.monotonic()
        label = self.m.model
        if self.first is None:
            self.first = now
            self.m.ttft.labels(label).observe(now - self.arrival)
            self.m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        elif self.last is not None:
            self.m.itl_series.observe(now - self.last)
        self.last = now
        self.num_generated += new
        self.m.gen_tokens_series.inc(new)

    def finish(self, reasons: list[str | None]) -> None:
        """Record the request's end; reasons holds each choice's finish reason (None: cut off)."""
        if self.done:
            return
        self.done = True
        label = self.m.model
        self.m.e2e.labels(label).observe(time.monotonic() - self.arrival)
        self.m.prompt_len.labels(label).observe(self.num_prompt_tokens)
        self.m.gen_len.labels(label).observe(self.num_generated)
        for r in reasons:
            self.m.success.labels(label, r or "abort").inc()
