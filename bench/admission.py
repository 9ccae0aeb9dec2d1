"""The scheduler alone on an offline run's traffic: preemptions and recomputed prompt tokens with
the KV headroom at admission (sched/headroom.py) and without it, and the step time a cost
model gives each schedule.

  python bench/admission.py                      # the H200 run: 55,857 blocks of 16 tokens
  python bench/admission.py --num-blocks 20000 --early-stop
  python bench/admission.py --smoke

The real Scheduler runs 1,000 x (1,000 in, 1,000 out) (ignore_eos, as `skyline bench offline`)
against a runner that samples a token for each request whose prompt is computed; with
--early-stop each request ends at an EOS after a uniform share of its max_tokens instead (with
--no-max-tokens it has none, as chat requests that do not set it, and ends there alike). No
model and no timing: the schedule is deterministic. The cost model prices each step as one
on the H200 would be at its floor (Llama-3.1-8B bf16: the weights' 15.0 GB and the decodes'
KV at 4.2 TB/s, the prefill tokens' products at 790 TFLOP/s), to rank the schedules, not to
predict a run's time.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from skyline.bench.offline import save_json
from skyline.config import CacheConfig, SchedulerConfig
from skyline.sched.scheduler import Scheduler
from skyline.types import Request, RunnerOutput, SamplingParams

WEIGHT_BYTES, KV_BYTES_PER_TOKEN, FLOPS_PER_TOKEN = 15.0e9, 131072, 2 * 7.5e9
BANDWIDTH, PEAK = 4.2e12, 790e12
EOS = 2


def simulate(num_blocks: int, num_prompts: int, input_len: int, output_len: int,
             max_num_seqs: int, budget: int, conservativeness: float, early_stop: bool,
             no_max_tokens: bool = False, seed: int = 0) -> dict[str, Any]:
    max_len = input_len + output_len + 48
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        max_model_len=max_len, schedule_conservativeness=conservativeness),
        CacheConfig(block_size=16, enable_prefix_caching=True), num_blocks)
    rng = random.Random(seed)
    ends = {}
    for i in range(num_prompts):
        rid = str(i)
        ends[rid] = rng.randint(1, output_len) if early_stop else output_len
        sched.add_request(Request(
            rid, [rng.randrange(3, 100_000) for _ in range(input_len)],
            SamplingParams(max_tokens=None if no_max_tokens else output_len,
                           ignore_eos=not early_stop),
            eos_token_ids=(EOS,)))
    steps = prefill = running = output = 0
    model_s = 0.0
    while sched.has_unfinished():
        so = sched.schedule()
        res = RunnerOutput()
        kv_tokens = step_prefill = 0
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
            else:
                step_prefill += n
        running += len(sched.running)
        prefill += step_prefill
        model_s += ((WEIGHT_BYTES + kv_tokens * KV_BYTES_PER_TOKEN) / BANDWIDTH
                    + step_prefill * FLOPS_PER_TOKEN / PEAK)
        output += sum(len(o.new_token_ids) for o in sched.update(so, res))
        steps += 1
    return {"conservativeness": conservativeness, "steps": steps,
            "preemptions": sched.num_preemptions, "prompt_tokens": num_prompts * input_len,
            "prefill_tokens": prefill, "recomputed_tokens": prefill - num_prompts * input_len,
            "output_tokens": output, "mean_running": running / steps,
            "headroom_ratio": sched.headroom.ratio, "model_s": model_s,
            "model_tok_s": output / model_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-blocks", type=int, default=55857,
                    help="KV blocks of 16 tokens (default: the H200 bf16 run's)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--early-stop", action="store_true",
                    help="each request ends at an EOS after a uniform share of max_tokens")
    ap.add_argument("--no-max-tokens", action="store_true",
                    help="with --early-stop: requests without max_tokens")
    ap.add_argument("--smoke", action="store_true", help="a small run (CI)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.no_max_tokens and not a.early_stop:
        ap.error("--no-max-tokens needs --early-stop (else every request runs to the length cap)")
    if a.smoke:
        a.num_blocks, a.num_prompts, a.input_len, a.output_len = 300, 40, 100, 100
    rows = []
    for cons in (0.0, 1.0):
        r = simulate(a.num_blocks, a.num_prompts, a.input_len, a.output_len, a.max_num_seqs,
                     a.max_num_batched_tokens, cons, a.early_stop, a.no_max_tokens)
        rows.append(r)
        print(f"conservativeness {cons:.0f}: {r['preemptions']} preemptions, "
              f"{r['recomputed_tokens']:,} prompt tokens recomputed, {r['steps']} steps, "
              f"{r['mean_running']:.0f} running on average; cost model {r['model_s']:.1f} s "
              f"({r['model_tok_s']:,.0f} output tok/s)")
    if a.smoke:
        assert rows[0]["preemptions"] > 0 and rows[1]["preemptions"] == 0, rows
    gain = rows[0]["model_s"] / rows[1]["model_s"]
    print(f"headroom against none, by the cost model: {gain:.3f}x")
    if a.out:
        save_json({"benchmark": "admission", "args": vars(a), "runs": rows}, a.out)


if __name__ == "__main__":
    main()
