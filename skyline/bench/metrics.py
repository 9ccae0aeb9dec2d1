"""Serving metrics from per-request timings: TTFT, TPOT, ITL, E2E percentiles, throughput and
goodput (requests per second that meet every latency objective)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its start."""

    input_len: int
    output_len: int = 0  # tokens generated (server usage when reported, else chunks)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (server usage)
    ttft: float = 0.0  # time to the first generated token
    e2e: float = 0.0  # time to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    start: float = 0.0  # seconds since the benchmark started
    success: bool = True
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for one-token outputs."""
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 (and std) of seconds, reported in milliseconds."""
    if not values_s:
        return {"mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan,
                "std": math.nan}
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return {"mean": mean, "median": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "std": std}


def split_first(results: list[RequestResult], n: int
                ) -> tuple[list[RequestResult], list[RequestResult]]:
    """The `n` requests that started first and the others: a closed loop's first wave (its
    users' first requests, sent together) and what followed."""
    order = sorted(results, key=lambda r: r.start)
    return order[:n], order[n:]


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in ("ttft", "tpot", "e2e") or ms <= 0:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of ttft, tpot, e2e and a "
                             f"positive number of milliseconds, got {spec!r}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot or 0.0}
    return all(values[k] * 1000.0 <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate metrics of one benchmark run that lasted `duration_s` seconds."""
    ok = [r for r in results if r.success]
    num_in = sum(r.input_len for r in ok)
    num_out = sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        # usage.prompt_tokens_details.cached_tokens over prompt tokens (0 if not reported)
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / num_in if num_in else 0.0,
        "request_throughput": len(ok) / dur,
        "output_throughput": num_out / dur,
        "total_token_throughput": (num_in + num_out) / dur,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        out["goodput"] = {"slos_ms": slos, "good_requests": good,
                          "request_goodput": good / dur,
                          "fraction": good / len(results) if results else math.nan}
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        out["errors"] = errors[:5]
    return out


def format_table(summary: dict[str, Any], title: str = "serving benchmark") -> str:
    """A readable fixed-width table of a summary."""
    lines = [f"{'=' * 20} {title} {'=' * 20}"]
    row = lambda k, v: lines.append(f"{k:<36}{v:>16}")
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Prefix cache hit rate:", f"{summary.get('prefix_hit_rate', 0.0):.3f}")
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")
    if "goodput" in summary:
        g = summary["goodput"]
        row("Request goodput (req/s):", f"{g['request_goodput']:.2f}")
        row("Requests meeting SLOs:", f"{g['good_requests']}/{summary['num_requests']}")
    for key, name in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token"),
                      ("itl_ms", "Inter-token latency"), ("e2e_ms", "End-to-end latency")):
        lines.append(f"{'-' * 14} {name} (ms) {'-' * 14}")
        s = summary[key]
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()}:", f"{s[stat]:.2f}")
    lines.append("=" * (42 + len(title)))
    return "\n".join(lines)
