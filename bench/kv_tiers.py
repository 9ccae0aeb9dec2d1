"""KV tiers on multi-turn chat (CPU, default model): prefix hit rate and TTFT with the KV tiers
against the device cache alone, in one run, with a device cache that holds about a tenth of the
conversations.

Each conversation resends its whole history every turn (`--workload multi-turn`); `concurrency`
users talk at once while the server runs as many requests as its cache holds whole
conversations (--max-num-seqs), the others queue: between two turns of one conversation the
others' turns evict its prefix from the device cache. One server per setting, the same
workload and seed for each:
  device  the device cache alone
  ram     plus a host-RAM tier big enough for every conversation (--kv-offload-ram)
  disk    plus a disk tier instead (--kv-offload-disk, its RAM write buffer only)
Hit rates are the servers' own counts (/metrics) of prompt tokens found in the device cache,
in RAM and on disk; TTFT is measured by the client (`skyline bench serve`).

  python bench/kv_tiers.py                  # 24 conversations x 4 turns, 12 users
  python bench/kv_tiers.py --smoke          # one tiny server run (CI: tests/bench/)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import tempfile
from typing import Any

from skyline.bench.frontier import start_server, stop_server
from skyline.bench.offline import save_json
from skyline.bench.serve import LoadSpec, run_serve_bench
from skyline.bench.workloads import WorkloadSpec

BLOCK = 16
TEMPLATE_TOKENS = 16  # per turn: "Turn t: say more about ...", "User:", "Assistant:"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=192, help="new tokens a turn")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--share", type=float, default=0.1,
                    help="conversations the device cache holds, as a share of all")
    ap.add_argument("--settings", default="device,ram,disk")
    ap.add_argument("--smoke", action="store_true", help="tiny run for CI")
    ap.add_argument("--out", default="bench/results/kv/kv-tiers-cpu-multi-turn.json")
    a = ap.parse_args()
    if a.smoke:  # every conversation in flight at once: they evict each other's prefixes
        a.conversations, a.turns, a.input_len, a.output_len, a.concurrency = 4, 2, 24, 4, 4
        a.settings, a.share = "ram", 0.25
        if a.out == ap.get_default("out"):
            a.out = None
    conv_tokens = a.turns * (a.input_len + a.output_len + TEMPLATE_TOKENS)
    max_len = -(-int(conv_tokens * 1.5) // BLOCK) * BLOCK
    # About `share` of the conversations fit; never less than one whole conversation.
    num_blocks = max(int(a.share * a.conversations * conv_tokens), max_len) // BLOCK
    running = max(1, num_blocks * BLOCK // conv_tokens)  # whole conversations that fit
    base = ["--device", "cpu", "--num-blocks", str(num_blocks), "--block-size", str(BLOCK),
            "--max-model-len", str(max_len), "--max-num-seqs", str(running),
            "--max-waiting", str(a.concurrency)]
    ram = f"{max(64, 2 * a.conversations * conv_tokens * 48_000 >> 20)}MiB"  # ~46 KB a token
    workload = WorkloadSpec("multi-turn", str(a.input_len), str(a.output_len), num_turns=a.turns,
                            seed=0)
    load = LoadSpec(concurrency=a.concurrency, num_requests=a.conversations * a.turns,
                    progress=False, setup_timeout=300.0)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        flags = {"device": base, "ram": [*base, "--kv-offload-ram", ram],
                 "disk": [*base, "--kv-offload-disk", os.path.join(tmp, "kv")]}
        for name in a.settings.split(","):
            print(f"== {name}: skyline serve {' '.join(flags[name])}", flush=True)
            proc, url = start_server(flags[name], os.path.join(tmp, f"{name}.log"), 300.0)
            try:
                res = run_serve_bench(dataclasses.replace(load, base_url=url), workload)
            finally:
                stop_server(proc)
            runs[name] = {"flags": flags[name], "summary": res["summary"],
                          "load_average_1min_after": os.getloadavg()[0]}
    result = {
        "benchmark": "kv_tiers",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": "default (SmolLM2-135M-Instruct Q4_1 GGUF, fp32 on the CPU)",
        "workload": dataclasses.asdict(workload), "conversations": a.conversations,
        "concurrency": a.concurrency, "max_num_seqs": running,
        "device_cache_tokens": num_blocks * BLOCK,
        "conversation_tokens_estimate": conv_tokens,
        "machine": {"host": platform.node(), "cpu_count": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0]},
        "runs": runs, "table": table(runs),
    }
    print_table(result["table"])
    save_json(result, a.out)


def table(runs: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    ref = runs.get("device", {}).get("summary", {}).get("ttft_ms", {})
    for name, r in runs.items():
        s = r["summary"]
        cache = s.get("server_cache") or {}
        rows.append({
            "setting": name, "completed": s["completed"], "failed": s["failed"],
            "hit_rate": cache.get("hit_rate"), "device_hit_rate": cache.get("device_hit_rate"),
            "ram_hit_rate": cache.get("ram_hit_rate"), "disk_hit_rate": cache.get("disk_hit_rate"),
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "ttft_p50_speedup": (ref["median"] / s["ttft_ms"]["median"]) if ref else None,
            "output_tok_s": s["output_throughput"],
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    print(f"{'setting':<8}{'hit rate':>9}{'device':>8}{'RAM':>7}{'disk':>7}{'TTFT p50':>10}"
          f"{'p99 ms':>9}{'speedup':>9}{'out tok/s':>11}")
    for r in rows:
        print(f"{r['setting']:<8}{f(r['hit_rate'], '.3f'):>9}{f(r['device_hit_rate'], '.3f'):>8}"
              f"{f(r['ram_hit_rate'], '.3f'):>7}{f(r['disk_hit_rate'], '.3f'):>7}"
              f"{f(r['ttft_p50_ms'], '.0f'):>10}{f(r['ttft_p99_ms'], '.0f'):>9}"
              f"{f(r['ttft_p50_speedup'], '.2f'):>9}{f(r['output_tok_s'], '.1f'):>11}")


if __name__ == "__main__":
    main()
