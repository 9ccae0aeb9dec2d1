"""One `skyline bench serve` run reported: the summary of its requests (bench/metrics.py), the
server's prefix-cache counters over the run, a table on stdout and the JSON file; and the HTTP
stack a served benchmark names."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

from skyline.bench.metrics import format_table, summarize
from skyline.bench.serve.load import CUT, LoadSpec, run_load
from skyline.bench.server_stats import cache_delta, format_cache, scrape
from skyline.bench.workloads import WorkloadSpec


def run_serve_bench(load: LoadSpec, workload: WorkloadSpec, slos: dict[str, float] | None = None,
                    output: str | None = None, print_table: bool = True) -> dict[str, Any]:
    """Run the load, print a table, optionally write JSON; returns the result dict."""
    before = scrape(load.base_url, load.api_key)
    results, duration, exact, model = run_load(load, workload)
    summary = summarize(results, duration, slos)
    cache = cache_delta(before, scrape(load.base_url, load.api_key))
    if cache is not None:
        summary["server_cache"] = cache
    out = {
        "benchmark": "serve",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": load.base_url, "model": model, "endpoint": load.endpoint,
        "load": {k: v for k, v in dataclasses.asdict(load).items() if k != "api_key"},
        "workload": dataclasses.asdict(workload),
        "token_exact_prompts": exact,
        "cut_requests": sum(r.error == CUT for r in results),
        "summary": summary,
        "requests": [{"start": r.start, "input_len": r.input_len, "output_len": r.output_len,
                      "cached_tokens": r.cached_tokens, "ttft": r.ttft, "e2e": r.e2e,
                      "success": r.success, "error": r.error}
                     for r in results],
    }
    if print_table:
        print(format_table(summary))
        if cache is not None:
            print(format_cache(cache))
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(out, f, indent=1)
        if print_table:
            print(f"wrote {output}")
    return out


def http_stack() -> str:
    """What uvicorn serves with here: its C event loop and HTTP parser when installed."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"{loop} + {'httptools' if importlib.util.find_spec('httptools') else 'h11'}"
