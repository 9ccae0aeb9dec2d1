"""Quality of the CPU's default decode path on GGUF files: the served default (the CPU plan:
decode-sized products on the integer dot kernel with activations rounded to int8 per 32, once
or twice, or on torch's int4 kernel in bfloat16) against the exact float32 model, with the
plan's other rounding count and the integer dot kernel turned off as baselines, in one run.

Each engine decodes greedily from the same prompts, one at a time (batch-1 steps); the exact
model then scores the served tokens (prompt log-probs over the prompt + continuation): top-1
agreement (the exact model's
argmax is the token served) and KL(exact || served) over the exact model's top 20 at each
served position (both renormalized over those 20: the engines return no more).

    python bench/cpu_decode_quality.py [--models q4_1,q8_0,q4_k_m] [--work-dir /tmp/cpu-vs-llamacpp]
        [--out bench/results/cpu/cpu-decode-quality.json]
    python bench/cpu_decode_quality.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import tempfile

from skyline import LLM, SamplingParams
from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import tiny_model
from skyline.engine.create import resolve_model_path
from skyline.ops import cpu_intdot, cpu_plan

FILES = {"q8_0": "smollm2-135m-Q8_0.gguf", "q4_k_m": "smollm2-135m-Q4_K_M.gguf"}
PROMPTS = ["The history of the printing press", "def fibonacci(n):",
           "A recipe for bread begins with", "Explain why the sky is blue."]


def decode(llm: LLM, prompts: list[list[int]], n: int) -> list[list[tuple[int, dict]]]:
    """Each prompt's greedy continuation: (token, {token: logprob} of the top 20) a position;
    one prompt at a time, so that every step is a batch-1 decode."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=20)
    outs = [llm.generate([p], params)[0] for p in prompts]
    return [[(t, _top(lp)) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                            strict=True)] for o in outs]


def _top(lp) -> dict[int, float]:
    return dict(zip(lp.token_ids, lp.logprobs, strict=True))


def score(exact: LLM, prompts: list[list[int]], served: list[list[tuple[int, dict]]]) -> dict:
    """Top-1 agreement and mean KL over the exact model's top 20."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=20)
    full = [p + [t for t, _ in s] for p, s in zip(prompts, served, strict=True)]
    agree, kls, n = 0, [], 0
    for o, p, s in zip(exact.generate(full, params), prompts, served, strict=True):
        for i, (tok, lp_served) in enumerate(s):
            ref = _top(o.prompt_logprobs[len(p) + i])  # the exact model's top 20 here
            agree += max(ref, key=ref.__getitem__) == tok
            top = sorted(ref, key=lambda t: -ref[t])[:20]
            p_ref = _norm([ref[t] for t in top])
            q = _norm([lp_served.get(t, -30.0) for t in top])
            kls.append(sum(a * (math.log(a) - math.log(b)) for a, b in zip(p_ref, q, strict=True)
                           if a > 0))
            n += 1
    return {"positions": n, "top1_agreement": agree / n, "kl_top20": sum(kls) / n}


def _norm(lps: list[float]) -> list[float]:
    m = max(lps)
    e = [math.exp(x - m) for x in lps]
    return [x / sum(e) for x in e]


def variants(plan: cpu_plan.CpuPlan) -> dict[str, cpu_plan.CpuPlan]:
    """The served plan, the same with the integer dot kernel's other rounding count, and with
    the kernel off (4-bit codes back on torch's int4 kernel where the plan had moved them)."""
    other = 3 - plan.intdot_rounds
    off = dataclasses.replace(plan, intdot_rows=0, int4_kernel="int4", int4_rows=(
        0 if plan.int4_kernel == "intdot" else plan.int4_rows))
    return {"served": plan,
            f"intdot, {'twice' if other == 2 else 'once'}": dataclasses.replace(
                plan, intdot_rounds=other),
            "no intdot": off}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="q4_1,q8_0,q4_k_m")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "cpu-vs-llamacpp"),
                    help="where bench/cpu_vs_llamacpp.py left the llama-quantize files")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/cpu/cpu-decode-quality.json")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    load = {}
    if args.smoke:
        paths, args.tokens, args.out, load = {"tiny": tiny_model()}, 4, "", {"load_format": "dummy"}
    else:
        paths = {}
        for name in args.models.split(","):
            path = (resolve_model_path(None, "auto") if name == "q4_1"
                    else os.path.join(args.work_dir, FILES[name]))
            if os.path.exists(path):
                paths[name] = path
            else:
                print(f"{name}: {path} is missing (bench/cpu_vs_llamacpp.py makes it); skipped")
    kw = dict(device="cpu", threads=args.threads, enable_prefix_caching=False, **load)
    rows, plan_of = [], cpu_plan.plan
    for name, path in paths.items():
        exact = LLM(model=path, dtype="float32", **kw)
        prompts = [exact.tokenizer.encode(p) for p in PROMPTS]
        for variant, plan in variants(plan_of()).items():
            cpu_plan.plan = lambda plan=plan: plan  # what the engine's loader reads
            try:
                served = LLM(model=path, **kw)
            finally:
                cpu_plan.plan = plan_of
            res = score(exact, prompts, decode(served, prompts, args.tokens))
            res |= {"model": name, "variant": variant, "plan": repr(plan)}
            rows.append(res)
            print(f"{name:7s} {variant:24s} top-1 agreement {res['top1_agreement']:.3f}  "
                  f"KL(top 20) {res['kl_top20']:.4f}", flush=True)
            del served
    save_json({"bench": "cpu_decode_quality", "date": datetime.date.today().isoformat(),
               "machine": machine_info("cpu"), "intdot_isa": cpu_intdot.isa(),
               "tokens": args.tokens, "prompts": PROMPTS, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
