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
  python bench/api_surface.py --smoke                           # seconds (CI)
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

STAGES = ("prompt-logprobs", "logit-bias", "constrained")
# The whole call a forced `get_weather` tool call is constrained to (tool_parsers/base.py
# wraps it in the model's call format).
CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "additionalProperties": False, "required": ["city", "days"],
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}


def _timed(llm: LLM, prompts: list[Any], params: SamplingParams | list[SamplingParams]
           ) -> tuple[float, int]:
    """Seconds of one `generate` and the tokens it produced."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def prompt_logprobs(llm: LLM, num: int, length: int, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(num, length, vocab, seed=1)
    base = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], base)  # warm-up
    res: dict[str, Any] = {"num_prompts": num, "prompt_len": length}
    for k in (None, 0, 5):
        p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=k)
        # no prefix reuse between the variants: a request that scores its prompt reuses none
        llm.engine.scheduler.reset_prefix_cache()
        dt, _ = _timed(llm, prompts, p)
        res[f"prefill_tok_s_k{k}"] = num * length / dt
    res["scored_over_plain_k0"] = res["prefill_tok_s_k0"] / res["prefill_tok_s_kNone"]
    res["scored_over_plain_k5"] = res["prefill_tok_s_k5"] / res["prefill_tok_s_kNone"]
    return res


def logit_bias(llm: LLM, batch: int, out_len: int, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(batch, 16, vocab, seed=2)
    bias = {t: -1.0 for t in range(1000, min(1300, vocab))}
    res: dict[str, Any] = {"batch": batch, "output_len": out_len, "biased_tokens": len(bias)}
    for name, b in (("plain", None), ("biased", bias)):
        p = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, logit_bias=b)
        llm.generate(prompts[:1], p)  # warm-up
        dt, n = _timed(llm, prompts, p)
        res[f"decode_tok_s_{name}"] = n / dt
    res["biased_over_plain"] = res["decode_tok_s_biased"] / res["decode_tok_s_plain"]
    return res


def constrained(llm: LLM, batches: list[int], max_tokens: int = 64) -> dict[str, Any]:
    if llm.tokenizer is None:
        return {"skipped": "the model has no tokenizer (dummy weights from a bare config)"}
    prompt = llm.tokenizer.encode("Call get_weather for the city the user names. User: what "
                                  "will the weather be in Lisbon for the next three days?")
    res: dict[str, Any] = {}
    for b in batches:
        forced = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                json_schema=json.dumps(CALL))
        llm.generate([prompt], forced)  # warm-up (builds the grammar's tokenizer view)
        dt_c, n_c = _timed(llm, [prompt] * b, forced)
        free = SamplingParams(temperature=0.0, max_tokens=max(n_c // b, 1), ignore_eos=True)
        dt_f, n_f = _timed(llm, [prompt] * b, free)
        res[f"batch{b}"] = {"forced_ms_per_token": 1e3 * dt_c / n_c,
                            "free_ms_per_token": 1e3 * dt_f / n_f,
                            "forced_over_free_time": (dt_c / n_c) / (dt_f / n_f),
                            "tokens_per_call": n_c / b}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--out", default=None, help="result JSON (default: none with --smoke)")
    a = ap.parse_args()
    stages = [s for s in a.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
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
    if "prompt-logprobs" in stages:
        res["prompt_logprobs"] = prompt_logprobs(llm, num, length, vocab)
    if "logit-bias" in stages:
        res["logit_bias"] = logit_bias(llm, batch, out_len, vocab)
    if "constrained" in stages:
        res["constrained"] = (constrained(llm, [1], max_tokens=6) if a.smoke
                              else constrained(llm, [1, batch]))
    llm.shutdown()
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
