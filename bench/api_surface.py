"""What the request surface costs the engine, each against the same work without it, measured
in one run:

  prompt-logprobs  prefill of N prompts x L tokens (one output token each), scoring every
                   prompt token (prompt_logprobs 0 and 5) against not scoring it
  logit-bias       decode of B requests with a 300-token logit_bias each against none
  constrained      decode of a forced tool call (the JSON schema of a whole call, as a
                   `tool_choice: required` request constrains it) at batch 1 and B, per output
                   token, against unconstrained decoding of as many tokens (needs the model's
                   tokenizer: skipped for dummy weights without one)

  python bench/api_surface.py                                   # default model, CPU
  python bench/api_surface.py --smoke                           # a tiny model, seconds (CI)
  python bench/api_surface.py --model llama-3.1-8b --load-format dummy --device cuda \\
      --stages prompt-logprobs,logit-bias --out bench/results/api/api-h200-llama-3.1-8b.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from skyline import LLM, SamplingParams
from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.bench.smoke import tiny_model

STAGES = ("prompt-logprobs", "logit-bias", "constrained")
# The whole call a forced `get_weather` tool call is constrained to (tool_parsers/base.py
# wraps it in the model's call format).
CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "additionalProperties": False, "required": ["city", "days"],
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}


def _best(llm: LLM, variants: dict[str, tuple[list[Any], SamplingParams]], reps: int
          ) -> dict[str, tuple[float, int]]:
    """Per variant (prompts, params): the fastest of `reps` `generate` calls, in seconds, and
    the tokens it produced. The variants take turns, so that a machine whose load drifts
    slows each alike."""
    best: dict[str, tuple[float, int]] = {}
    for _ in range(reps):
        for name, (prompts, params) in variants.items():
            # no prefix reuse across calls: a request that scores its prompt reuses none
            llm.engine.scheduler.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            if name not in best or dt < best[name][0]:
                best[name] = (dt, sum(len(o.outputs[0].token_ids) for o in outs))
    return best


def prompt_logprobs(llm: LLM, num: int, length: int, vocab: int, reps: int) -> dict[str, Any]:
    prompts = random_prompts(num, length, vocab, seed=1)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up
    best = _best(llm, {str(k): (prompts, SamplingParams(temperature=0.0, max_tokens=1,
                                                         ignore_eos=True, prompt_logprobs=k))
                       for k in (None, 0, 5)}, reps)
    res: dict[str, Any] = {"num_prompts": num, "prompt_len": length, "reps": reps}
    for k, (dt, _) in best.items():
        res[f"prefill_tok_s_k{k}"] = num * length / dt
    for k in ("0", "5"):
        res[f"scored_over_plain_k{k}"] = best["None"][0] / best[k][0]
    return res


def logit_bias(llm: LLM, batch: int, out_len: int, vocab: int, reps: int) -> dict[str, Any]:
    prompts = random_prompts(batch, 16, vocab, seed=2)
    bias = {t: -1.0 for t in range(vocab // 4, min(vocab // 4 + 300, vocab))}
    variants = {name: (prompts, SamplingParams(temperature=0.0, max_tokens=out_len,
                                               ignore_eos=True, logit_bias=b))
                for name, b in (("plain", None), ("biased", bias))}
    llm.generate(prompts[:1], variants["biased"][1])  # warm-up
    best = _best(llm, variants, reps)
    res: dict[str, Any] = {"batch": batch, "output_len": out_len, "biased_tokens": len(bias),
                           "reps": reps}
    for name, (dt, n) in best.items():
        res[f"decode_tok_s_{name}"] = n / dt
    res["biased_over_plain"] = best["plain"][0] / best["biased"][0]
    return res


def constrained(llm: LLM, batches: list[int], reps: int, max_tokens: int = 64
                ) -> dict[str, Any]:
    if llm.tokenizer is None:
        return {"skipped": "the model has no tokenizer (dummy weights from a bare config)"}
    prompt = llm.tokenizer.encode("Call get_weather for the city the user names. User: what "
                                  "will the weather be in Lisbon for the next three days?")
    forced = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=json.dumps(CALL))
    try:
        out = llm.generate([prompt], forced)  # warm-up (builds the grammar's tokenizer view)
    except ValueError as e:  # llguidance cannot read this tokenizer
        return {"skipped": str(e)}
    num = len(out[0].outputs[0].token_ids)  # greedy: every forced call is this long
    free = SamplingParams(temperature=0.0, max_tokens=num, ignore_eos=True)
    res: dict[str, Any] = {"tokens_per_call": num, "reps": reps}
    for b in batches:
        best = _best(llm, {"forced": ([prompt] * b, forced), "free": ([prompt] * b, free)},
                     reps)
        res[f"batch{b}"] = {f"{name}_ms_per_token": 1e3 * dt / n
                            for name, (dt, n) in best.items()}
        res[f"batch{b}"]["forced_over_free_time"] = ((best["forced"][0] / best["forced"][1])
                                                     / (best["free"][0] / best["free"][1]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--reps", type=int, default=3, help="calls per variant (the fastest "
                    "counts), taking turns")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (seconds)")
    ap.add_argument("--out", default=None, help="result JSON (default: none with --smoke)")
    a = ap.parse_args()
    stages = [s for s in a.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    if a.smoke:  # a tiny random model: every code path in seconds, no figure meaningful
        a.model, a.load_format = a.model or tiny_model(), "dummy"
    llm = LLM(a.model, load_format=a.load_format, device=a.device,
              max_model_len=512 if a.smoke else 4096)
    vocab = llm.config.model.arch.vocab_size
    cuda = llm.config.device.startswith("cuda")
    num, length = (2, 24) if a.smoke else ((64, 2048) if cuda else (8, 512))
    batch, out_len = (2, 2) if a.smoke else ((64, 128) if cuda else (16, 32))
    res: dict[str, Any] = {
        "benchmark": "api_surface", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "python bench/api_surface.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
            if v not in (None, False) and k != "out"),
        "model": llm.config.model.name, "device": llm.config.device,
        "dtype": llm.config.model.dtype, "machine": machine_info(llm.config.device)}
    reps = 1 if a.smoke else a.reps
    if "prompt-logprobs" in stages:
        res["prompt_logprobs"] = prompt_logprobs(llm, num, length, vocab, reps)
    if "logit-bias" in stages:
        res["logit_bias"] = logit_bias(llm, batch, out_len, vocab, reps)
    if "constrained" in stages:
        res["constrained"] = (constrained(llm, [1], reps, max_tokens=6) if a.smoke
                              else constrained(llm, [1, batch], reps))
    llm.shutdown()
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
