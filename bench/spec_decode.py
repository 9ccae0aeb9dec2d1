"""Speculative decoding on CPU with the embedded SmolLM2-135M-Instruct (GGUF): batch-1 speedup
of n-gram, suffix and EAGLE-head speculation over plain decoding on a code-editing workload (the
answer mostly repeats the prompt) and a chat workload, and throughput at high load, all greedy.

    python bench/spec_decode.py [--methods none,ngram,suffix,eagle,eagle-head]
                                [--eagle-head DIR]
                                [--out bench/results/spec/spec-cpu-smollm2.json]
    python bench/spec_decode.py --smoke   # a tiny random model, a few tokens: the code

Each method gets its own engine, all alive at once. Batch-1 workloads interleave the methods
prompt by prompt (and `--rounds` times over, rotating the order), so that the load of a shared
machine drifts as little as possible between the runs a ratio compares; the high-load workload
runs once per method, in turn. `eagle` is the engine's EAGLE method (the head, with prompt
lookup for the spans a request repeats), `eagle-head` the head alone; both need a head
(`skyline train-speculator`; default: the head shipped for the default model,
skyline/worker/spec/heads/smollm2-135m). Greedy outputs must be the same with and without
speculation; the script checks it. The prompts are skyline/bench/spec_prompts.py's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from typing import Any

from skyline import LLM, SamplingParams
from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import tiny_model
from skyline.bench.spec_prompts import CHAT, chat_prompts, code_prompts, warm_up

SPEC_COUNTERS = ("spec_num_verifications", "spec_num_draft_tokens", "spec_num_accepted_tokens")

def _counters(llm: LLM) -> dict[str, float]:
    stats = llm.engine.stats()
    return {k: stats.get(k, 0) for k in SPEC_COUNTERS}


def _spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["acceptance_rate"] = (d["spec_num_accepted_tokens"] / d["spec_num_draft_tokens"]
                            if d["spec_num_draft_tokens"] else 0.0)
    d["mean_accepted_length"] = (1 + d["spec_num_accepted_tokens"] / d["spec_num_verifications"]
                                 if d["spec_num_verifications"] else 0.0)
    return d


def run_b1(llms: dict[str, LLM], prompts: list[list[int]], max_tokens: int,
           rounds: int) -> dict[str, dict[str, Any]]:
    """Batch 1, methods interleaved prompt by prompt; each method's time is the sum of its
    requests' times."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    methods = list(llms)
    elapsed = {m: 0.0 for m in methods}
    outs: dict[str, list[list[int]]] = {m: [] for m in methods}
    before = {m: _counters(llms[m]) for m in methods}
    for r in range(rounds):
        for i, p in enumerate(prompts):
            k = (r * len(prompts) + i) % len(methods)
            for m in methods[k:] + methods[:k]:  # rotate who goes first
                t0 = time.perf_counter()
                toks = llms[m].generate([p], params)[0].outputs[0].token_ids
                elapsed[m] += time.perf_counter() - t0
                if r == 0:
                    outs[m].append(list(toks))
    res = {}
    for m in methods:
        n = sum(len(o) for o in outs[m]) * rounds
        res[m] = {"elapsed_s": elapsed[m], "output_tokens": n,
                  "output_tokens_per_s": n / elapsed[m], "outputs": outs[m],
                  "spec": _spec_delta(before[m], _counters(llms[m]))}
    return res


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = _counters(llm)
    t0 = time.perf_counter()
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    dt = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    return {"elapsed_s": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "outputs": outs,
            "spec": _spec_delta(before, _counters(llm))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/spec/spec-cpu-smollm2.json")
    ap.add_argument("--methods", default="none,ngram,suffix,eagle,eagle-head",
                    help="comma-separated; none (the baseline) is always run; eagle is the "
                         "head with prompt lookup for repeated spans (the engine's default), "
                         "eagle-head the head alone")
    ap.add_argument("--eagle-head", default=None,
                    help="EAGLE head directory (default: the head shipped for the default model)")
    ap.add_argument("--draft-model", default=None,
                    help="draft: the draft model (a smaller model with the target's tokenizer)")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="draft without --draft-model: the target's own first N layers")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--code-max-tokens", type=int, default=512)
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument("--chat-prompts", type=int, default=len(CHAT))
    ap.add_argument("--rounds", type=int, default=1, help="batch-1 passes over the prompts")
    ap.add_argument("--load-requests", type=int, default=32)
    ap.add_argument("--load-max-tokens", type=int, default=64)
    ap.add_argument("--skip-load", action="store_true", help="batch-1 workloads only")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: no spinning threads fighting a busy machine)")
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per engine (CUDA: set it, all engines share one GPU)")
    ap.add_argument("--skip-b1", action="store_true", help="the high-load workload only")
    ap.add_argument("--random-prompt-len", type=int, default=0,
                    help="high load: random prompts of this many tokens (models without a "
                         "tokenizer, e.g. dummy weights) instead of chat and code prompts")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model (no EAGLE head: none, ngram, suffix and draft "
                         "from its first layer), a few tokens of each workload, no JSON")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.load_format, args.out = tiny_model(), "dummy", None
        args.methods, args.draft_layers, args.num_blocks = "none,ngram,suffix,draft", 1, 256
        args.code_max_tokens, args.chat_max_tokens, args.chat_prompts = 16, 8, 2
        args.load_requests, args.load_max_tokens = 4, 8
    methods = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    llms = {m: LLM(model=args.model, load_format=args.load_format, device=args.device,
                   dtype=args.dtype, num_blocks=args.num_blocks,
                   speculative_method=m.split("-")[0],
                   num_speculative_tokens=args.num_speculative_tokens, threads=args.threads,
                   speculative_model=args.eagle_head if m.startswith("eagle")
                   else args.draft_model if m == "draft" else None,
                   speculative_draft_layers=args.draft_layers
                   if m == "draft" and not args.draft_model else 0,
                   eagle_lookup=m != "eagle-head")
            for m in methods}
    anyllm = llms["none"]
    b1 = {} if args.skip_b1 else {
        "code_edit_b1": (code_prompts(anyllm), args.code_max_tokens),
        "chat_b1": (chat_prompts(anyllm, args.chat_prompts), args.chat_max_tokens)}
    load: list[list[int]] = []
    if not args.skip_load and args.random_prompt_len:
        g = random.Random(0)
        vocab = anyllm.config.model.arch.vocab_size
        load = [[g.randrange(10, vocab) for _ in range(args.random_prompt_len)]
                for _ in range(args.load_requests)]
    elif not args.skip_load:
        code = code_prompts(anyllm)
        load = chat_prompts(anyllm, args.load_requests - len(code)) + code
    for llm in llms.values():
        warm_up(llm, args.device, [p for ps, _ in b1.values() for p in ps],
                [] if args.random_prompt_len else load)
    results: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for w, (prompts, max_tokens) in b1.items():
        for m, v in run_b1(llms, prompts, max_tokens, args.rounds).items():
            results[m][w] = v
            print(f"{m:8} {w:14} {v['output_tokens_per_s']:.2f} tok/s", flush=True)
    workloads = list(b1)
    if load:
        w = f"load_{args.load_requests}"
        workloads.append(w)
        for m in methods:
            results[m][w] = run_batch(llms[m], load, args.load_max_tokens)
            print(f"{m:8} {w:14} {results[m][w]['output_tokens_per_s']:.2f} tok/s", flush=True)

    base = results["none"]
    print(f"\n{'method':8} {'workload':14} {'tokens':>7} {'time s':>8} {'tok/s':>8} "
          f"{'speedup':>8} {'accept':>7} {'len':>5} identical")
    for m in methods:
        for w in workloads:
            v = results[m][w]
            v["speedup"] = v["output_tokens_per_s"] / base[w]["output_tokens_per_s"]
            v["identical_to_none"] = v["outputs"] == base[w]["outputs"]
            sp = v["spec"]
            print(f"{m:8} {w:14} {v['output_tokens']:7d} {v['elapsed_s']:8.2f} "
                  f"{v['output_tokens_per_s']:8.1f} {v['speedup']:7.2f}x "
                  f"{sp['acceptance_rate']:7.2f} {sp['mean_accepted_length']:5.2f} "
                  f"{v['identical_to_none']}")
    for m in methods:
        for w in workloads:
            del results[m][w]["outputs"]
    doc = {
        "benchmark": "speculative decoding, batch-1 speedup and high-load throughput",
        "model": args.model or "SmolLM2-135M-Instruct Q4_1 (GGUF, embedded default)",
        "device": args.device,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "machine_info": machine_info(args.device),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "params": vars(args),
        "eagle_head": next((llm.config.spec.model for m, llm in llms.items()
                            if m.startswith("eagle")), None),
        "results": results,
    }
    save_json(doc, args.out)


if __name__ == "__main__":
    main()
