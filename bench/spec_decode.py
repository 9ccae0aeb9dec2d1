"""Speculative decoding on CPU with the embedded SmolLM2-135M-Instruct (GGUF): batch-1 speedup
of n-gram and suffix speculation over plain decoding on a code-editing workload (the answer
mostly repeats the prompt) and a chat workload, and throughput at high load, all greedy.

    python bench/spec_decode.py [--out bench/results/spec-cpu-smollm2.json]

Each method gets its own engine; each workload runs once per engine after a short warm-up (so
the suffix proposer sees only the traffic of the workloads before it), the methods in turn.
Greedy outputs must be the same with and without speculation; the script checks it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any

from skyline import LLM, SamplingParams

SNIPPETS = [
    '''def summarize_orders(orders, tax_rate, currency="EUR"):
    """Group orders by customer and compute totals with tax."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if amount <= 0:
            continue
        if customer not in totals:
            totals[customer] = 0.0
            counts[customer] = 0
        totals[customer] += amount
        counts[customer] += 1
    report = []
    for customer, total in sorted(totals.items()):
        taxed = total * (1 + tax_rate)
        average = total / counts[customer]
        line = {
            "customer": customer,
            "orders": counts[customer],
            "total": round(total, 2),
            "taxed": round(taxed, 2),
            "average": round(average, 2),
            "currency": currency,
        }
        report.append(line)
    grand_total = sum(item["taxed"] for item in report)
    largest = max(report, key=lambda item: item["taxed"]) if report else None
    summary = {
        "customers": len(report),
        "grand_total": round(grand_total, 2),
        "largest": largest["customer"] if largest else None,
        "currency": currency,
    }
    return report, summary
''',
    '''def parse_log_lines(lines, min_level="INFO"):
    """Parse log lines into records and count them by level."""
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    threshold = levels.index(min_level)
    records = []
    counts = {level: 0 for level in levels}
    for raw in lines:
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        parts = raw.split(" ", 3)
        if len(parts) < 4:
            continue
        date, clock, level, message = parts
        if level not in levels:
            continue
        if levels.index(level) < threshold:
            continue
        counts[level] += 1
        record = {
            "date": date,
            "time": clock,
            "level": level,
            "message": message,
        }
        records.append(record)
    errors = [r for r in records if r["level"] == "ERROR"]
    first_error = errors[0]["message"] if errors else None
    result = {
        "records": records,
        "counts": counts,
        "first_error": first_error,
        "total": len(records),
    }
    return result
''',
]
RENAMES = [("customer", "client"), ("record", "entry")]

CHAT = [
    "What are three good habits for staying healthy? Answer in a short paragraph.",
    "Explain what a binary search is to a beginner.",
    "Write a short poem about the sea.",
    "Give me a few tips for learning a new language.",
]


def code_prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.render_chat([{"role": "user", "content":
                          f"Rewrite this function with `{a}` renamed to `{b}`. Output only the "
                          f"code.\n\n```python\n{code}```"}])
        for code, (a, b) in zip(SNIPPETS, RENAMES, strict=True)
    ]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.render_chat([{"role": "user", "content": CHAT[i % len(CHAT)] + f" ({i})"}])
            for i in range(n)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, batch: bool) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    if batch:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    else:  # batch 1: one request after the other
        outs = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    dt = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    return {"elapsed_s": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/spec-cpu-smollm2.json")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--code-max-tokens", type=int, default=512)
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument("--load-requests", type=int, default=32)
    ap.add_argument("--load-max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: no spinning threads fighting a busy machine)")
    args = ap.parse_args()
    methods = ["none", "ngram", "suffix"]
    # All engines live at once and every workload runs on each in turn, so that the load of a
    # shared machine drifts as little as possible between the runs a ratio compares.
    llms = {m: LLM(speculative_method=m, num_speculative_tokens=args.num_speculative_tokens,
                   threads=args.threads) for m in methods}
    for llm in llms.values():
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    anyllm = llms["none"]
    code = code_prompts(anyllm)
    workloads = {
        "code_edit_b1": (code, args.code_max_tokens, False),
        "chat_b1": (chat_prompts(anyllm, len(CHAT)), args.chat_max_tokens, False),
        f"load_{args.load_requests}": (chat_prompts(anyllm, args.load_requests - len(code))
                                       + code, args.load_max_tokens, True),
    }
    results: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for w, (prompts, max_tokens, batch) in workloads.items():
        for m in methods:
            results[m][w] = run(llms[m], prompts, max_tokens, batch)
            print(f"{m:8} {w:14} {results[m][w]['output_tokens_per_s']:.2f} tok/s", flush=True)
    for m in methods:
        results[m]["stats"] = {k: v for k, v in llms[m].engine.stats().items()
                               if k.startswith("spec_")}

    base = results["none"]
    table = []
    for method in methods:
        for w in workloads:
            v = results[method][w]
            v["speedup"] = v["output_tokens_per_s"] / base[w]["output_tokens_per_s"]
            v["identical_to_none"] = v["outputs"] == base[w]["outputs"]
            table.append((method, w, v["output_tokens"], v["elapsed_s"],
                          v["output_tokens_per_s"], v["speedup"], v["identical_to_none"]))
    print(f"\n{'method':8} {'workload':14} {'tokens':>7} {'time s':>8} {'tok/s':>8} "
          f"{'speedup':>8} identical")
    for m, w, n, dt, tps, sp, same in table:
        print(f"{m:8} {w:14} {n:7d} {dt:8.2f} {tps:8.1f} {sp:7.2f}x {same}")
    for m in methods[1:]:
        s = results[m]["stats"]
        print(f"{m}: acceptance {s['spec_acceptance_rate']:.2f}, mean accepted length "
              f"{s['spec_mean_accepted_length']:.2f}")
    for m in methods:
        for w in workloads:
            del results[m][w]["outputs"]
    doc = {
        "benchmark": "speculative decoding, batch-1 speedup and high-load throughput",
        "model": "SmolLM2-135M-Instruct Q4_1 (GGUF, embedded default)",
        "device": "cpu",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "params": vars(args),
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
