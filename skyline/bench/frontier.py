"""`skyline frontier`: sweep engine settings x load levels of one workload, score each setting's
quality offline, and report the Pareto front (bench/report.py).

Each setting is a `skyline serve` started on a free port with the base flags plus one value of
every --grid flag; each load level is one `bench serve` run against it. The sweep's JSON is
rewritten after every point, so a killed sweep continues where it stopped.

Quality: next-token distributions of the setting vs the reference (--reference-flags, by default
unquantized) on a calibration text, by teacher forcing (`LLM.score`, one causal forward):
mean KL(reference || setting), top-1 agreement and the setting's perplexity. Settings that differ
only in flags that cannot change the model's outputs (scheduler, cache, speculative decoding)
share one measurement. Dummy (random) weights get no quality measurement: their distributions
say nothing about a trained model's, so the sweep records quality as not applicable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import itertools
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from skyline.bench.serve import LoadSpec, run_serve_bench
from skyline.bench.workloads import WorkloadSpec, parse_len
from skyline.configs import dummy_config_dir
from skyline.engine.args import EngineArgs
from skyline.engine.create import resolve_device
from skyline.progress import bar

# EngineArgs fields that never change next-token distributions (speculative decoding is lossless).
_NO_QUALITY = {"max_model_len", "block_size", "kv_cache_memory", "gpu_memory_utilization",
               "num_blocks", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
               "max_waiting", "schedule_conservativeness", "seed", "served_model_name",
               "threads", "enforce_eager",
               "speculative_method", "num_speculative_tokens", "ngram_min", "ngram_max",
               "speculative_max_batch_tokens"}
_STATE = "frontier.json"


@dataclass
class FrontierSpec:
    grid: list[str]
    base_flags: str = ""
    concurrency: str = "1,4"
    output_dir: str = "bench/tmp/frontier"
    quality: bool = True
    reference_flags: str = "--quantization none"
    calib_tokens: int = 512
    num_gpus: int = 1
    percentile: str = "median"
    startup_timeout: float = 600.0
    ports: tuple[int, int] | None = None  # the servers' ports: the first free one in LO..HI


def parse_grid(entries: list[str]) -> list[tuple[str, list[str]]]:
    """['max_num_seqs=4,16'] -> [('--max-num-seqs', ['4', '16'])]."""
    grid = []
    for e in entries:
        name, sep, values = e.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name.strip() or not vals:
            raise ValueError(f"--grid takes FLAG=V1,V2,..., got {e!r}")
        grid.append(("--" + name.strip().lstrip("-").replace("_", "-"), vals))
    return grid


def grid_settings(grid: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Every combination as serve flags; true/false values switch a flag on or off."""
    out = []
    for combo in itertools.product(*[vals for _, vals in grid]):
        flags: list[str] = []
        for (flag, _), v in zip(grid, combo, strict=True):
            if v.lower() in ("true", "on"):
                flags.append(flag)
            elif v.lower() not in ("false", "off"):
                flags += [flag, v]
        out.append(flags)
    return out


def concurrencies(spec: str) -> list[int]:
    try:
        levels = [int(c) for c in spec.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency takes positive integers like 1,8,32, got {spec!r}")
    return levels


def quality_key(args: EngineArgs) -> str:
    d = {k: v for k, v in dataclasses.asdict(args).items() if k not in _NO_QUALITY}
    return json.dumps(d, sort_keys=True, default=str)


def quality_status(spec: FrontierSpec, ref_args: EngineArgs) -> str:
    """'measured', 'off' (--no-quality) or why quality does not apply (dummy weights)."""
    if not spec.quality:
        return "off"
    shipped = ref_args.model is not None and not os.path.exists(ref_args.model) and \
        dummy_config_dir(ref_args.model) is not None
    if ref_args.load_format == "dummy" or shipped:
        return ("not applicable: dummy (random) weights; KL and top-1 agreement are measured "
                "on trained models only")
    return "measured"


def calibration_text() -> str:
    """The text `skyline quantize` calibrates on by default (skyline/tools/calibration.txt)."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "calibration.txt")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _score(args: EngineArgs, calib_tokens: int) -> tuple[Any, list[int]]:
    """Reference-free scoring run: [n, vocab] log-probs and the text's token ids."""
    import gc

    from skyline.engine.frontend.llm import LLM

    n = calib_tokens + 16
    kw = dataclasses.asdict(args) | {
        "max_model_len": n, "num_blocks": -(-n // args.block_size) + 1, "enforce_eager": True,
        "speculative_method": "none", "max_num_seqs": 1}
    llm = LLM(**kw)
    ids = llm.encode(calibration_text())[1][:calib_tokens]
    logp = llm.score(ids, window=calib_tokens)[0].float().cpu()  # off the GPU: servers follow
    del llm
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give the scoring run's memory back before a server starts
    return logp, ids


def measure_quality(args: EngineArgs, ref: Any, ids: list[int], calib_tokens: int
                    ) -> dict[str, float]:
    logq, _ = _score(args, calib_tokens)
    p = ref.exp()
    kl = (p * (ref - logq)).sum(-1)  # [n]
    agree = (ref.argmax(-1) == logq.argmax(-1)).float()
    nll = -logq[:-1].gather(1, logq.new_tensor(ids[1:]).long()[:, None]).squeeze(1)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
            "top1_agreement": float(agree.mean()), "perplexity": math.exp(float(nll.mean())),
            "num_tokens": len(ids)}


def free_port(ports: tuple[int, int] | None = None) -> int:
    """A port free on 127.0.0.1: any (None), or the first free one in `ports` (LO, HI)."""
    for port in [0] if ports is None else range(ports[0], ports[1] + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no port in {ports[0]}..{ports[1]} is free; give another --port range")


def start_server(flags: list[str], log_path: str, timeout: float,
                 ports: tuple[int, int] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port(ports)
    cmd = [sys.executable, "-m", "skyline.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, f"http://127.0.0.1:{port}/v1"
            except OSError:
                time.sleep(0.5)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline or sys.exc_info()[0]:
            stop_server(proc)  # timed out, or killed (SIGTERM -> SystemExit) while waiting
    stop_server(proc)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-600:]
    raise RuntimeError(f"skyline serve {shlex.join(flags)} did not start: {tail}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _load_state(path: str, sweep: dict[str, Any]) -> dict[str, Any]:
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        if state.get("sweep", {}).get("workload") != sweep["workload"] or \
                state["sweep"].get("load") != sweep["load"]:
            raise ValueError(f"{path} holds a sweep of another workload or load; pass another "
                             "--output-dir or delete it")
        state["sweep"] = sweep
        return state
    return {"sweep": sweep, "points": [], "quality": {}, "startup_s": []}


def _save(path: str, state: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def _estimate(state: dict[str, Any], todo: list[tuple[list[str], int]], load: LoadSpec,
              workload: WorkloadSpec, num_settings: int) -> float:
    """Seconds the remaining points take: measured means of finished ones, else a CPU guess."""
    done = [p["summary"]["duration_s"] for p in state["points"] if "summary" in p]
    startup = (sum(state["startup_s"]) / len(state["startup_s"])) if state["startup_s"] else 30.0
    if done:
        per_point = sum(done) / len(done)
        return num_settings * startup + sum(per_point for _ in todo)
    out_hi = parse_len(workload.output_len, "--output-len")[1] if workload.name != "file" else 64
    total = num_settings * startup
    for _, c in todo:  # guess: 20 tokens/s for each user
        t = math.ceil((load.num_requests or 100) / c) * out_hi / 20.0
        total += min(t, load.duration) if load.duration else t
    return total


def _heartbeat(load: LoadSpec) -> float:
    """Seconds between progress lines of one load level: about three per level, 10 s to 60 s."""
    return min(max((load.duration or 60.0) / 3, 10.0), 60.0)


def _bound(load: LoadSpec) -> str:
    if load.duration:
        return f"{load.duration:g} s, cut at {load.duration + load.grace:g} s"
    return f"{load.num_requests} requests"


@contextlib.contextmanager
def _watchdog(load: LoadSpec) -> Iterator[None]:
    """Every thread's stack on stderr if one load level outlives its bounds by a minute: the
    client bounds itself (set-up, duration + grace), so this only fires on a hang in code that
    does not yield, and then shows where."""
    armed = bool(load.duration) and sys.__stderr__ is not None
    if armed:
        try:
            faulthandler.dump_traceback_later(
                load.setup_timeout + (load.duration or 0) + load.grace + 60, file=sys.__stderr__)
        except (ValueError, OSError):  # no real stderr to write to
            armed = False
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def run_frontier(spec: FrontierSpec, load: LoadSpec, workload: WorkloadSpec,
                 slos: dict[str, float], parse_flags: Callable[[list[str]], EngineArgs],
                 dry_run: bool = False) -> dict[str, Any]:
    from skyline.bench.report import write_report

    base = shlex.split(spec.base_flags)
    settings = grid_settings(parse_grid(spec.grid))
    levels = concurrencies(spec.concurrency)
    for flags in settings:
        parse_flags(base + flags)  # every flag checked before anything starts
    ref_args = parse_flags(base + shlex.split(spec.reference_flags))
    os.makedirs(spec.output_dir, exist_ok=True)
    path = os.path.join(spec.output_dir, _STATE)
    sweep = {"grid": spec.grid, "base_flags": spec.base_flags, "levels": levels,
             "workload": dataclasses.asdict(workload),
             "load": {"endpoint": load.endpoint, "num_requests": load.num_requests,
                      "duration": load.duration, "ignore_eos": load.ignore_eos},
             "slos_ms": slos, "num_gpus": spec.num_gpus, "percentile": spec.percentile,
             "reference_flags": spec.reference_flags, "calib_tokens": spec.calib_tokens,
             "device": resolve_device(parse_flags(base).device).split(":")[0]}
    sweep["quality"] = quality_status(spec, ref_args)
    state = _load_state(path, sweep)
    done = {(p["setting"], p["concurrency"]) for p in state["points"]}
    todo = [(f, c) for f in settings for c in levels if (shlex.join(f), c) not in done]
    todo_settings = {shlex.join(f) for f, _ in todo}
    if dry_run:
        for f in settings:
            for c in levels:
                mark = "done" if (shlex.join(f), c) in done else "todo"
                print(f"[{mark}] concurrency {c:>4}: skyline serve {shlex.join(base + f)}")
        est = _estimate(state, todo, load, workload, len(todo_settings))
        print(f"{len(todo)} of {len(settings) * len(levels)} points to run in "
              f"{len(todo_settings)} server starts; rough estimate {est / 60:.1f} min")
        return state
    # A killed sweep (SIGTERM) still stops its server: `finally` below runs on SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ref = ids = None
    points = bar(total=len(todo), desc="frontier", unit=" points")
    for flags in settings:
        key = shlex.join(flags)
        pending = [c for c in levels if (key, c) not in done]
        args = parse_flags(base + flags)
        qkey = quality_key(args)
        if sweep["quality"] == "measured" and qkey not in state["quality"]:
            if qkey == quality_key(ref_args):
                state["quality"][qkey] = {"kl_mean": 0.0, "kl_p99": 0.0, "top1_agreement": 1.0,
                                          "reference": True}
            else:
                if ref is None:
                    print("scoring the reference on the calibration text")
                    ref, ids = _score(ref_args, spec.calib_tokens)
                print(f"scoring quality of {key or '(base flags)'}")
                state["quality"][qkey] = measure_quality(args, ref, ids, spec.calib_tokens)
            _save(path, state)
        if not pending:
            continue
        slug = "".join(ch if ch.isalnum() else "_" for ch in key).strip("_") or "base"
        os.makedirs(os.path.join(spec.output_dir, "runs"), exist_ok=True)
        t0 = time.monotonic()
        command = f"skyline serve {shlex.join(base + flags)}".strip()
        print(f"starting: {command}")
        try:
            proc, url = start_server(base + flags, os.path.join(spec.output_dir, "runs",
                                                                  f"{slug}.log"),
                                     spec.startup_timeout, spec.ports)
        except RuntimeError as e:
            print(f"skipped: {e}")
            points.update(len(pending))
            for c in pending:
                state["points"].append({"setting": key, "concurrency": c, "command": command,
                                        "quality_key": qkey, "error": str(e)[:600]})
            _save(path, state)
            continue
        state["startup_s"].append(time.monotonic() - t0)
        try:
            for c in pending:
                run = os.path.join(spec.output_dir, "runs", f"{slug}-c{c}.json")
                level = dataclasses.replace(load, base_url=url, concurrency=c, model=None,
                                            progress=False, setup_timeout=spec.startup_timeout,
                                            heartbeat=_heartbeat(load))
                print(f"  concurrency {c}: running ({_bound(level)}), "
                      f"{time.strftime('%H:%M:%S')}", flush=True)
                try:
                    with _watchdog(level):
                        res = run_serve_bench(level, workload, slos, run, print_table=False)
                except ValueError as e:  # the server stopped answering: on to the next setting
                    print(f"  concurrency {c}: failed: {e}", flush=True)
                    state["points"].append({"setting": key, "concurrency": c,
                                            "command": command, "quality_key": qkey,
                                            "error": str(e)[:600]})
                    _save(path, state)
                    break
                points.update()
                s = res["summary"]
                bad = f", {s['failed']} failed ({res['cut_requests']} cut)" if s["failed"] else ""
                print(f"  concurrency {c}: {s['output_throughput']:.1f} output tok/s, "
                      f"TTFT median {s['ttft_ms']['median']:.0f} ms, "
                      f"TPOT median {s['tpot_ms']['median']:.1f} ms, "
                      f"{s['completed']} requests in {s['duration_s']:.1f} s{bad}", flush=True)
                state["points"].append({"setting": key, "flags": flags, "concurrency": c,
                                        "command": command, "quality_key": qkey,
                                        "summary": s, "run": os.path.basename(run)})
                _save(path, state)
        finally:
            stop_server(proc)
    points.close()
    paths = write_report(state, spec.output_dir)
    print("wrote " + ", ".join(paths))
    return state
