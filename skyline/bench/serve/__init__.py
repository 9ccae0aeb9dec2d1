"""`skyline bench serve`: a streaming load generator for any OpenAI-compatible endpoint.

Load is fixed concurrency (N users, each sending its next request when the last one ends),
Poisson arrivals at a request rate, or both (arrivals capped at N in flight). A run ends after
`num_requests` requests or `duration` seconds, whichever comes first; requests in flight then
have `grace` seconds to finish. Nothing waits without bound on the server: the set-up requests
(model id, token-id probe, warm-up) have `setup_timeout` seconds, and at the hard deadline
(duration + grace) the requests still running are cut, recorded as failed, and the run reports
what it has. `heartbeat` prints a progress line every so many seconds (a stalled server shows).

load.py holds the load (`LoadSpec`, `run_load`, `LoadProcesses`), client.py the client that
sends one streamed request and times its tokens, report.py the run's summary, table and JSON
(`run_serve_bench`).
"""

from skyline.bench.serve.load import CUT, MAX_WARMUP_WIDTH, LoadProcesses, LoadSpec, run_load
from skyline.bench.serve.report import http_stack, run_serve_bench

__all__ = ["CUT", "MAX_WARMUP_WIDTH", "LoadProcesses", "LoadSpec", "http_stack", "run_load",
           "run_serve_bench"]
