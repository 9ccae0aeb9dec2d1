"""The scheduler alone on an offline run's traffic (or served arrivals): preemptions and
recomputed prompt tokens with the KV headroom at admission (sched/headroom.py) and without it,
and the step time a cost model gives each schedule.

  python bench/admission.py                      # the H200 bf16 run: 55,857 blocks of 16 tokens
  python bench/admission.py --fp8                # the H200 fp8 run: 116,977 blocks
  python bench/admission.py --num-blocks 20000 --early-stop
  python bench/admission.py --early-stop --rate 35   # served: Poisson arrivals
  python bench/admission.py --smoke

The real Scheduler runs 1,000 x (1,000 in, 1,000 out) (ignore_eos, as `skyline bench offline`)
against a runner that samples a token for each request whose prompt is computed; with
--early-stop each request ends at an EOS after a uniform share of its max_tokens instead (with
--no-max-tokens it has none, as chat requests that do not set it, and ends there alike). No
model and no timing: the schedule is deterministic. With --rate the requests arrive as a
Poisson process on the cost model's clock instead (served traffic), and the time to each one's
first token is reported. Three schedules: no headroom (conservativeness 0), the headroom
without its rule for a queue that fits the free blocks ("plan only": a remainder held back
then runs alone, a tail of small steps), and the headroom as the engine runs it.

The cost model prices each step as one on the H200 would be at its floor (Llama-3.1-8B: the
decodes' products at the larger of the weights over 4.2 TB/s and their FLOPs at the matmul
peak, the decodes' KV over 4.2 TB/s, the prefill tokens' products at the peak; bf16: 15.0 GB of
weights, 128 KiB of KV a token, 790 TFLOP/s; --fp8: 8.0 GB, 64 KiB, 1,400 TFLOP/s) plus
STEP_S, what an H100 run's decode steps took beyond those terms (8.96 ms at 34 sequences,
26.4 ms at 481: ~4 ms each), to rank the schedules, not to predict a run's time.
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from typing import Any

from skyline.bench.metrics import percentile
from skyline.bench.offline import save_json
from skyline.config import CacheConfig, SchedulerConfig
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, RunnerOutput, SamplingParams

# (weight bytes, KV bytes a token, matmul peak) and the run's KV blocks
COSTS = {"bf16": (15.0e9, 131072, 790e12, 55857), "fp8": (8.0e9, 65536, 1400e12, 116977)}
FLOPS_PER_TOKEN, BANDWIDTH, STEP_S = 2 * 7.5e9, 4.2e12, 0.004
EOS = 2


def simulate(num_blocks: int, num_prompts: int, input_len: int, output_len: int,
             max_num_seqs: int, budget: int, conservativeness: float, early_stop: bool,
             no_max_tokens: bool = False, costs: str = "bf16", start_all: bool = True,
             rate: float = 0.0, seed: int = 0) -> dict[str, Any]:
    weight_bytes, kv_bytes, peak, _ = COSTS[costs]
    max_len = input_len + output_len + 48
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        max_model_len=max_len, schedule_conservativeness=conservativeness),
        CacheConfig(block_size=16, enable_prefix_caching=True), num_blocks)
    if not start_all:
        sched.headroom.overcommit = None
    rng = random.Random(seed)
    ends, arrivals, first = {}, deque(), {}
    clock = 0.0
    for i in range(num_prompts):
        rid = str(i)
        ends[rid] = rng.randint(1, output_len) if early_stop else output_len
        clock += rng.expovariate(rate) if rate else 0.0
        arrivals.append((clock, Request(
            rid, [rng.randrange(3, 100_000) for _ in range(input_len)],
            SamplingParams(max_tokens=None if no_max_tokens else output_len,
                           ignore_eos=not early_stop),
            eos_token_ids=(EOS,))))
    arrived = {}
    steps = prefill = running = output = 0
    model_s = 0.0
    while arrivals or sched.has_unfinished():
        if not sched.has_unfinished():
            model_s = max(model_s, arrivals[0][0])  # idle until the next arrival
        while arrivals and arrivals[0][0] <= model_s:
            at, req = arrivals.popleft()
            arrived[req.request_id] = at
            sched.add_request(req)
        so = sched.schedule()
        res = RunnerOutput()
        kv_tokens = step_prefill = decodes = 0
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            res.req_ids.append(rid)
            res.logprobs.append(None)
            if req.num_computed_tokens >= req.num_tokens:  # samples this step
                last = req.num_output_tokens + 1 >= ends[rid]
                res.sampled_token_ids.append([EOS if last else 3])
            else:
                res.sampled_token_ids.append([])
            if n == 1:
                kv_tokens += req.num_computed_tokens
                decodes += 1
            else:
                step_prefill += n
        running += len(sched.running)
        prefill += step_prefill
        model_s += (STEP_S + max(weight_bytes / BANDWIDTH, decodes * FLOPS_PER_TOKEN / peak)
                    + kv_tokens * kv_bytes / BANDWIDTH + step_prefill * FLOPS_PER_TOKEN / peak)
        for o in sched.update(so, res):
            output += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = model_s - arrived[o.request_id]
        steps += 1
    return {"conservativeness": conservativeness, "steps": steps,
            "preemptions": sched.num_preemptions, "prompt_tokens": num_prompts * input_len,
            "prefill_tokens": prefill, "recomputed_tokens": prefill - num_prompts * input_len,
            "output_tokens": output, "mean_running": running / steps,
            "ttft_p50_s": percentile(list(first.values()), 50),
            "ttft_p99_s": percentile(list(first.values()), 99),
            "headroom_ratio": sched.headroom.ratio, "model_s": model_s,
            "model_tok_s": output / model_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks of 16 tokens (default: the H200 run's, bf16 or fp8)")
    ap.add_argument("--fp8", action="store_true",
                    help="fp8 weights and KV (the cost model's; the H200 fp8 run's cache)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--early-stop", action="store_true",
                    help="each request ends at an EOS after a uniform share of max_tokens")
    ap.add_argument("--no-max-tokens", action="store_true",
                    help="with --early-stop: requests without max_tokens")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="Poisson arrivals, requests per second of the cost model's clock "
                         "(default 0: all at once, as offline)")
    ap.add_argument("--smoke", action="store_true", help="a small run (CI)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.no_max_tokens and not a.early_stop:
        ap.error("--no-max-tokens needs --early-stop (else every request runs to the length cap)")
    if a.smoke:
        a.num_blocks, a.num_prompts, a.input_len, a.output_len = 300, 52, 100, 90
    costs = "fp8" if a.fp8 else "bf16"
    blocks = a.num_blocks or COSTS[costs][3]
    rows = []
    for name, cons, start_all in (("none", 0.0, True), ("plan only", 1.0, False),
                                  ("headroom", 1.0, True)):
        r = simulate(blocks, a.num_prompts, a.input_len, a.output_len, a.max_num_seqs,
                     a.max_num_batched_tokens, cons, a.early_stop, a.no_max_tokens, costs,
                     start_all, a.rate)
        rows.append({"schedule": name, **r})
        print(f"{name:9s}: {r['preemptions']} preemptions, "
              f"{r['recomputed_tokens']:,} prompt tokens recomputed, {r['steps']} steps, "
              f"{r['mean_running']:.0f} running on average; cost model {r['model_s']:.1f} s "
              f"({r['model_tok_s']:,.0f} output tok/s); TTFT p50 {r['ttft_p50_s']:.2f} s, "
              f"p99 {r['ttft_p99_s']:.2f} s")
    if a.smoke and not (a.rate or a.early_stop):
        assert rows[1]["preemptions"] == 0, rows
        assert rows[2]["preemptions"] < rows[0]["preemptions"], rows
        assert rows[2]["steps"] < rows[1]["steps"], rows
    for r in rows[1:]:
        print(f"{r['schedule']} against none, by the cost model: "
              f"{rows[0]['model_s'] / r['model_s']:.3f}x")
    if a.out:
        save_json({"benchmark": "admission", "args": vars(a), "runs": rows}, a.out)


if __name__ == "__main__":
    main()
