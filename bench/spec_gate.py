"""The measured speculation gate under load: throughput of 32 concurrent greedy requests (the
chat and code prompts of bench/spec_decode.py) with no speculation, with speculation forced in
every step, and with the gate, the static batch-size bound lifted so that only the gate decides.

    python bench/spec_gate.py [--methods ngram,suffix] [--rounds 2]
                              [--out bench/results/spec/spec-gate-load-cpu-smollm2.json]
    python bench/spec_gate.py --smoke   # a tiny random model, a few tokens: the code

Every configuration gets its own engine, all alive at once; the configurations run in turn,
`--rounds` times over with the order reversed each round, so that the drift of a shared machine
cancels in the ratios. Each configuration's time is the sum over rounds. Greedy outputs must be
the same in every configuration; the script checks it. Runs on CUDA too (--device cuda
--num-blocks N, all engines sharing one GPU).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from skyline import LLM, SamplingParams
from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import tiny_model
from skyline.bench.spec_prompts import chat_prompts, code_prompts, warm_up


def _gate_stats(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}


def _spec_steps(s: dict[str, float]) -> tuple[float, float]:
    """(steps the gate decided, of which speculative)."""
    n = s.get("spec_gate_steps", 0.0)
    return n, n * s.get("spec_gate_speculated_fraction", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/spec/spec-gate-load-cpu-smollm2.json")
    ap.add_argument("--methods", default="ngram,suffix")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, 4 requests of 8 tokens, one round, no JSON")
    args = ap.parse_args()
    model: dict[str, Any] = {}
    if args.smoke:
        model = {"model": tiny_model(), "load_format": "dummy"}
        args.methods, args.requests, args.max_tokens, args.rounds = "ngram", 4, 8, 1
        args.num_blocks, args.out = 256, None
    kw = dict(device=args.device, threads=args.threads, num_blocks=args.num_blocks,
              num_speculative_tokens=args.num_speculative_tokens,
              speculative_max_batch_tokens=1 << 16, **model)
    configs: dict[str, dict[str, Any]] = {"none": {}}
    for m in args.methods.split(","):
        configs[f"{m}-forced"] = dict(speculative_method=m, speculative_gate=False)
        configs[f"{m}-gate"] = dict(speculative_method=m)
    llms = {name: LLM(**kw, **c) for name, c in configs.items()}
    code = code_prompts(llms["none"])
    prompts = chat_prompts(llms["none"], args.requests - len(code)) + code
    for llm in llms.values():
        warm_up(llm, args.device, [], prompts)
    before = {name: _spec_steps(_gate_stats(llm)) for name, llm in llms.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    names = list(llms)
    elapsed = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            outs = [list(o.outputs[0].token_ids) for o in llms[name].generate(prompts, params)]
            elapsed[name] += time.perf_counter() - t0
            tokens[name] += sum(len(o) for o in outs)
            outputs.setdefault(name, outs)
            print(f"round {r} {name:14} {tokens[name] / elapsed[name]:.1f} tok/s", flush=True)
    results = {}
    base = tokens["none"] / elapsed["none"]
    print(f"\n{'config':14} {'tok/s':>8} {'vs none':>8} {'spec steps':>10} identical")
    for name in names:
        tps = tokens[name] / elapsed[name]
        s = _gate_stats(llms[name])
        steps, spec = (a - b for a, b in zip(_spec_steps(s), before[name], strict=True))
        s["spec_gate_speculated_fraction"] = spec / steps if steps else 0.0  # timed rounds
        results[name] = {"elapsed_s": elapsed[name], "output_tokens": tokens[name],
                         "output_tokens_per_s": tps, "speedup": tps / base,
                         "identical_to_none": outputs[name] == outputs["none"], "stats": s}
        print(f"{name:14} {tps:8.1f} {tps / base:7.2f}x "
              f"{s.get('spec_gate_speculated_fraction', 0.0):10.3f} "
              f"{results[name]['identical_to_none']}")
    save_json({
        "benchmark": "speculation gate at high load (static batch bound lifted)",
        "model": "SmolLM2-135M-Instruct Q4_1 (GGUF, embedded default)",
        "device": args.device,
        "machine_info": machine_info(args.device),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "params": vars(args),
        "results": results,
    }, args.out)


if __name__ == "__main__":
    main()
