"""A fleet behind one endpoint (`skyline serve --replicas N`, skyline/router/), measured.

    python bench/fleet.py [--stages routing,kill,overhead] [--smoke] [--out-dir DIR]
    python bench/fleet.py --stages gpu          # the H200 stage (one GPU, two engines)

Stages, each writing DIR/<stage>.json (default DIR: bench/results/fleet):
- routing: two replicas of the default model on the CPU behind the router, a shared-prefix
  workload (several system prompts, more than one replica's cache holds) and a multi-turn one,
  with cache-aware routing and with round-robin (each on fresh replicas, same prompts), and
  one engine whose cache holds every prefix (the hit rate to reach): prefix hit rate (the
  replicas' usage.cached_tokens over prompt tokens), TTFT p50/p99, and the ratios.
- kill: a replica killed (SIGKILL) mid-load: every request ends (none cut at the deadline),
  those not started on it complete on the other, streams it was serving end with an error
  event; the router's retries and cut streams, and the time until the restarted replica
  rejoins.
- overhead: the router's own cost: a stub replica that streams as fast as it can, asked
  directly and through the router (cache-aware, prompts hashed): added time per token and to
  the first token.
- gpu: one GPU, two engines: colocated (both do everything, cache-aware) against
  prefill + decode on a mixed workload (long prompts among short chats): goodput under TTFT and
  TPOT objectives, and the KV transfer rate against the device's copy rate (bench/fleet_gpu.py;
  with --smoke it runs on the CPU, as a check).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from skyline.bench.frontier import start_server, stop_server
from skyline.bench.metrics import summarize
from skyline.bench.offline import machine_info, save_json
from skyline.bench.serve import CUT, LoadSpec, run_load
from skyline.bench.workloads import WorkloadSpec

HERE = os.path.dirname(os.path.abspath(__file__))


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def router_metrics(base: str) -> dict[str, float]:
    """The router's /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def per_replica(m: dict[str, float], name: str) -> dict[str, float]:
    pat = re.compile(rf'^skyline_router:{name}\{{replica="([^"]+)"\}}$')
    return {g.group(1): v for k, v in m.items() if (g := pat.match(k))}


class Fleet:
    """`skyline serve --replicas N` (replicas and router) in a subprocess."""

    def __init__(self, flags: list[str], log_path: str, n: int = 2,
                 timeout: float = 900.0) -> None:
        self.n = n
        self.proc, url = start_server(["--replicas", str(n), *flags], log_path, timeout)
        self.base = url[: -len("/v1")]
        self.url = url
        self.wait_joined(timeout)

    def healthy(self) -> dict[str, float]:
        return per_replica(router_metrics(self.base), "replica_healthy")

    def wait_joined(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(self.healthy().values()) < self.n or not router_metrics(self.base).get(
                "skyline_router:prompt_hashing_ready"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the fleet's replicas did not all join")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_server(self.proc)


def run(url: str, workload: WorkloadSpec, concurrency: int, num_requests: int,
        endpoint: str = "chat", duration: float | None = None, warmup: int = 0,
        slos: dict[str, float] | None = None) -> dict[str, Any]:
    load = LoadSpec(base_url=url, endpoint=endpoint, concurrency=concurrency,
                    num_requests=num_requests, duration=duration, warmup=warmup, progress=False,
                    grace=120.0, setup_timeout=300.0)
    results, seconds, _, _ = run_load(load, workload)
    s = summarize(results, seconds, slos)
    s["cut_requests"] = sum(r.error == CUT for r in results)
    return s


def brief(s: dict[str, Any]) -> dict[str, Any]:
    return {"completed": s["completed"], "failed": s["failed"],
            "prefix_hit_rate": s["prefix_hit_rate"], "ttft_ms_p50": s["ttft_ms"]["median"],
            "ttft_ms_p99": s["ttft_ms"]["p99"], "tpot_ms_p50": s["tpot_ms"]["median"],
            "request_throughput": s["request_throughput"], "duration_s": s["duration_s"]}


# ------------------------------------------------------------------------------ routing


class Router:
    """A second `skyline router` over replicas another router already fronts."""

    def __init__(self, replicas: list[str], policy: str, log_path: str) -> None:
        from skyline.bench.frontier import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        args = [arg for r in replicas for arg in ("--replica", f"http://{r}")]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "skyline.cli", "router", *args, "--policy", policy,
                 "--port", str(self.port), "--uvicorn-log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT)
        _wait(f"{self.base}/health")

    def stop(self) -> None:
        stop_server(self.proc)


def stage_routing(a: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    """`fleet` routes cache-aware; a round-robin router is started over the same replicas.
    Each policy gets its own prompts (another seed, same lengths), so that one cannot hit
    what the other left in the replicas' caches."""
    def workloads(seed: int) -> dict[str, WorkloadSpec]:
        return {
            "shared-prefix": WorkloadSpec("shared-prefix", str(a.question_len),
                                          str(a.output_len), system_prompt_len=a.prefix_len,
                                          seed=seed, num_prefixes=a.num_prefixes),
            "multi-turn": WorkloadSpec("multi-turn", str(a.turn_len), str(a.output_len),
                                       num_turns=a.turns, seed=seed),
        }

    rows: dict[str, dict[str, Any]] = {}
    # One engine whose cache holds every prefix: the hit rate routing should approach.
    proc, url = start_server([*engine_flags(a), "--num-blocks", str(a.reference_blocks)],
                             os.path.join(a.log_dir, "reference.log"), 900)
    try:
        for name, wl in workloads(a.seed).items():
            rows[f"single engine, every prefix cached/{name}"] = row = brief(
                run(url, wl, a.concurrency, a.requests))
            print(name, "single", row, flush=True)
    finally:
        stop_server(proc)
    rr = Router(sorted(fleet.healthy()), "round-robin", os.path.join(a.log_dir, "rr.log"))
    try:
        for policy, router, seed in (("cache-aware", fleet, a.seed),
                                     ("round-robin", rr, a.seed + 1)):
            for name, wl in workloads(seed).items():
                before = router_metrics(router.base)
                row = brief(run(router.url, wl, a.concurrency, a.requests))
                after = router_metrics(router.base)
                row["routed_per_replica"] = {
                    k: v - per_replica(before, "requests_total").get(k, 0)
                    for k, v in per_replica(after, "requests_total").items()}
                rows[f"2 replicas, {policy}/{name}"] = row
                print(name, policy, row, flush=True)
    finally:
        rr.stop()
    ratios = {}
    for name in workloads(a.seed):
        ca, rr_ = rows[f"2 replicas, cache-aware/{name}"], rows[f"2 replicas, round-robin/{name}"]
        ref = rows[f"single engine, every prefix cached/{name}"]["prefix_hit_rate"]
        ratios[name] = {
            "ttft_p50_round_robin_over_cache_aware": rr_["ttft_ms_p50"] / ca["ttft_ms_p50"],
            "ttft_p99_round_robin_over_cache_aware": rr_["ttft_ms_p99"] / ca["ttft_ms_p99"],
            "hit_rate_cache_aware_over_single": ca["prefix_hit_rate"] / ref if ref else None,
            "hit_rate_round_robin_over_single": rr_["prefix_hit_rate"] / ref if ref else None,
        }
    return {"rows": rows, "ratios": ratios,
            "workloads": {k: vars(v) for k, v in workloads(a.seed).items()},
            "replica_blocks": a.replica_blocks, "reference_blocks": a.reference_blocks,
            "concurrency": a.concurrency, "requests": a.requests}


def engine_flags(a: argparse.Namespace) -> list[str]:
    return ["--device", "cpu", "--max-num-seqs", str(a.max_num_seqs), *a.flags.split()]


# ------------------------------------------------------------------------------ kill


def stage_kill(a: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    """Kill one of `fleet`'s replicas (its API process; its engine follows) mid-load."""
    wl = WorkloadSpec("shared-prefix", str(a.question_len), str(a.kill_output_len),
                      system_prompt_len=a.prefix_len, seed=a.seed + 2,
                      num_prefixes=a.num_prefixes)
    victim = sorted(fleet.healthy())[0]
    pid = get_json(f"http://{victim}/fleet")["pid"]
    killed_at: list[float] = []
    rejoined_at: list[float] = []
    done = threading.Event()

    def kill_then_watch() -> None:
        """Kill the victim, then note when the router has it back (its launcher restarts
        it), until the load and the rejoin timeout are over."""
        time.sleep(a.kill_after)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        seen_down = False
        while not done.is_set() or time.monotonic() - killed_at[0] < a.rejoin_timeout:
            time.sleep(0.5)
            try:
                up = fleet.healthy().get(victim)
            except OSError:
                continue
            seen_down = seen_down or not up
            if up and seen_down:
                rejoined_at.append(time.monotonic())
                return

    before = router_metrics(fleet.base)
    watcher = threading.Thread(target=kill_then_watch)
    watcher.start()
    t0 = time.monotonic()
    s = run(fleet.url, wl, a.concurrency, a.kill_requests, duration=a.kill_duration)
    done.set()
    watcher.join()
    m = router_metrics(fleet.base)

    def delta(name: str) -> float:
        return sum(per_replica(m, name).values()) - sum(per_replica(before, name).values())

    out = {"victim": victim, "killed_after_s": killed_at[0] - t0, "requests": s["num_requests"],
           "completed": s["completed"], "failed": s["failed"],
           "cut_at_deadline": s["cut_requests"], "errors": s.get("errors", []),
           "router_retries": delta("retries_total"),
           "router_failed_streams": delta("failed_streams_total"),
           "routed": {k: v - per_replica(before, "requests_total").get(k, 0)
                      for k, v in per_replica(m, "requests_total").items()},
           "load_s": time.monotonic() - t0,
           "rejoined": bool(rejoined_at),
           "rejoin_s_after_kill": rejoined_at[0] - killed_at[0] if rejoined_at else None}
    print("kill", out, flush=True)
    return out


# ------------------------------------------------------------------------------ overhead


def serve_stub(port: int, itl_s: float) -> None:
    """A replica that answers at once, one SSE event every `itl_s` seconds (0: as fast as it
    can write them)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            chunk = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if itl_s:
                await asyncio.sleep(itl_s)
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response()

    async def fleet(request: web.Request) -> web.Response:
        return web.json_response({"role": "both", "block_size": 16, "kv_events_port": None})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", ok)
    app.router.add_get("/fleet", fleet)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


def stage_overhead(a: argparse.Namespace) -> dict[str, Any]:
    from skyline.bench.frontier import free_port

    stub_port, router_port = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-stub", str(stub_port),
                               "--overhead-itl-ms", str(a.overhead_itl_ms)])]
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "skyline.cli", "router", "--replica",
         f"http://127.0.0.1:{stub_port}", "--port", str(router_port), "--uvicorn-log-level",
         "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    rows = []
    try:
        _wait(f"http://127.0.0.1:{stub_port}/health")
        _wait(f"http://127.0.0.1:{router_port}/health")
        deadline = time.monotonic() + 120
        while not router_metrics(f"http://127.0.0.1:{router_port}").get(
                "skyline_router:prompt_hashing_ready") and time.monotonic() < deadline:
            time.sleep(0.2)
        wl = WorkloadSpec("shared-prefix", "32", str(a.overhead_tokens), system_prompt_len=256)
        for c in a.overhead_concurrency:
            res = {}
            for name, port in (("direct", stub_port), ("router", router_port)):
                cpu0 = cpu_seconds(procs[1].pid)
                res[name] = run(f"http://127.0.0.1:{port}/v1", wl, c, a.overhead_requests,
                                endpoint="completions", warmup=1)
                router_cpu = cpu_seconds(procs[1].pid) - cpu0
            tokens = a.overhead_tokens
            e2e = {k: v["e2e_ms"]["mean"] for k, v in res.items()}
            row = {"concurrency": c, "tokens_per_request": tokens,
                   "stub_itl_ms": a.overhead_itl_ms,
                   "direct_e2e_ms_mean": e2e["direct"], "router_e2e_ms_mean": e2e["router"],
                   "added_us_per_token": (e2e["router"] - e2e["direct"]) * 1000 / tokens,
                   "added_ttft_ms_p50": res["router"]["ttft_ms"]["median"]
                   - res["direct"]["ttft_ms"]["median"],
                   "direct_tokens_per_s": res["direct"]["output_throughput"],
                   "router_tokens_per_s": res["router"]["output_throughput"],
                   # the router process's CPU time (user + system) per token it relayed,
                   # warm-up requests included
                   "router_cpu_us_per_token": router_cpu * 1e6 / (
                       tokens * (a.overhead_requests + c))}
            rows.append(row)
            print("overhead", row, flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    return {"rows": rows}


# ------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="routing,kill,overhead")
    ap.add_argument("--smoke", action="store_true", help="a few requests per stage (CI)")
    ap.add_argument("--out-dir", default=None, help="default: bench/results/fleet (a --smoke "
                    "run writes nothing unless given one)")
    ap.add_argument("--log-dir", default="/tmp/skyline-fleet-bench")
    ap.add_argument("--flags", default="", help="extra `skyline serve` flags for every engine")
    ap.add_argument("--prefix-len", type=int, default=768, help="system prompt tokens")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=128, help="multi-turn: tokens a turn adds")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--replica-blocks", type=int, default=320,
                    help="KV blocks of each replica: room for about half the prefixes")
    ap.add_argument("--reference-blocks", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-requests", type=int, default=48)
    ap.add_argument("--kill-output-len", type=int, default=48)
    ap.add_argument("--kill-after", type=float, default=20.0, help="seconds into the load")
    ap.add_argument("--kill-duration", type=float, default=600.0, help="the load's time limit")
    ap.add_argument("--rejoin-timeout", type=float, default=300.0)
    ap.add_argument("--overhead-tokens", type=int, default=256)
    ap.add_argument("--overhead-requests", type=int, default=64)
    ap.add_argument("--overhead-concurrency", default="1,16")
    ap.add_argument("--overhead-itl-ms", type=float, default=2.0,
                    help="the stub's time between tokens (each its own event on the wire)")
    ap.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    sys.path.insert(0, HERE)
    from fleet_gpu import add_args, stage_gpu  # type: ignore[import-not-found]

    add_args(ap)
    a = ap.parse_args()
    if a.serve_stub is not None:
        return serve_stub(a.serve_stub, a.overhead_itl_ms / 1000)
    a.overhead_concurrency = [int(c) for c in str(a.overhead_concurrency).split(",")]
    # SIGTERM unwinds (stopping the servers this run started) instead of leaving them behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.smoke:
        a = argparse.Namespace(**{**vars(a), **SMOKE})
    os.makedirs(a.log_dir, exist_ok=True)
    names = a.stages.split(",")
    stages = {"routing": stage_routing, "kill": stage_kill, "overhead": stage_overhead,
              "gpu": stage_gpu}
    unknown = [n for n in names if n not in stages]
    if unknown:
        raise SystemExit(f"unknown stage {unknown[0]!r}; choose from routing, kill, overhead, "
                         "gpu")
    # routing and kill share one pair of CPU replicas (killing one comes last)
    fleet = None
    if "routing" in names or "kill" in names:
        fleet = Fleet([*engine_flags(a), "--num-blocks", str(a.replica_blocks), "--policy",
                       "cache-aware"], os.path.join(a.log_dir, "fleet.log"))
    try:
        for name in sorted(names, key=lambda n: n == "kill"):
            t0 = time.monotonic()
            result = (stages[name](a, fleet) if name in ("routing", "kill")
                      else stages[name](a))
            result.update({"benchmark": f"fleet/{name}", "smoke": a.smoke,
                           "command": "python " + " ".join(sys.argv),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "seconds": time.monotonic() - t0,
                           "machine": machine_info(
                               "cuda" if name == "gpu" and not a.smoke else "cpu")})
            out_dir = a.out_dir or (None if a.smoke else os.path.join(HERE, "results", "fleet"))
            save_json(result, out_dir and os.path.join(
                out_dir, f"{name}{'-smoke' if a.smoke else ''}.json"))
    finally:
        if fleet is not None:
            fleet.stop()


# A few requests per stage on tiny prompts: every path runs, in about a minute a stage.
SMOKE = {"prefix_len": 64, "num_prefixes": 2, "question_len": 8, "output_len": 2, "turns": 2,
         "turn_len": 16,
         "concurrency": 2, "requests": 6, "replica_blocks": 64, "reference_blocks": 128,
         "kill_requests": 12, "kill_output_len": 24, "kill_after": 3.0, "kill_duration": 120.0,
         "rejoin_timeout": 1.0, "overhead_tokens": 32, "overhead_requests": 8,
         "overhead_concurrency": [4]}


if __name__ == "__main__":
    main()
