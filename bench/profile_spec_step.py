"""Where a speculative step's time goes on the host: plain decoding against speculation forced in
every step, with the Python profiler over the speculative run.

    python bench/profile_spec_step.py --device cuda [--requests 64] [--depth 5]
    python bench/profile_spec_step.py --smoke   # a tiny random model on the CPU: the code

The model has the default model's shape (SmolLM2-135M: 30 layers, hidden 576, vocab 49,152)
with random weights, written to a temporary directory, unless `--model` names one. Drafts are
synthetic: every request proposes `--depth` copies of its last token in every step and verifies
them all (the adaptive depth is pinned), whatever the weights predict: acceptance changes how
many tokens a step emits, hardly what it costs. The figures are per step: plain decoding
(CUDA graphs, async scheduling) and speculative steps (verification graphs, synchronous), and
the functions with the most host time in the speculative run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch

from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.bench.smoke import tiny_model
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams


def smollm2_shape(path: str) -> None:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the default model's shape, random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, 4 requests of 8 tokens, on the CPU")
    a = ap.parse_args()
    path, load_format = a.model, "auto"
    if a.smoke:
        path, load_format, a.device, a.dtype = tiny_model(), "dummy", "cpu", "float32"
        a.requests, a.prompt_len, a.max_tokens, a.num_blocks, a.top = 4, 16, 8, 64, 5
    elif path is None:
        path = tempfile.mkdtemp(prefix="smollm2-shape-")
        smollm2_shape(path)
    kw = dict(device=a.device, dtype=a.dtype, num_blocks=a.num_blocks, max_num_seqs=a.requests,
              load_format=load_format)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    plain = LLM(path, **kw)
    prompts = random_prompts(a.requests, a.prompt_len, plain.config.model.arch.vocab_size)
    run(plain, prompts, params)  # warm-up
    plain_s, plain_tokens = run(plain, prompts, params)
    plain_steps = a.max_tokens  # one token per request per step
    del plain
    spec = LLM(path, speculative_method="ngram", speculative_gate=False,
               num_speculative_tokens=a.depth, speculative_max_batch_tokens=1 << 20, **kw)
    spec.query("repeat_drafts")  # synthetic drafts: the last token, depth times
    spec.engine.scheduler.spec.depth = lambda req_id: a.depth  # whatever the acceptance
    run(spec, prompts, params)  # warm-up
    prof = cProfile.Profile()
    before = spec.engine.stats().get("spec_num_verifications", 0)
    prof.enable()
    spec_s, spec_tokens = run(spec, prompts, params)
    prof.disable()
    verifications = spec.engine.stats().get("spec_num_verifications", 0) - before
    spec_steps = verifications / a.requests
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(a.top)
    top = []
    for (file, line, fn), (_, calls, tottime, cumtime, _) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][2])[: a.top]:
        top.append({"function": f"{file.split('/skyline/')[-1]}:{line}({fn})", "calls": calls,
                    "tottime_s": round(tottime, 4), "cumtime_s": round(cumtime, 4)})
    res = {
        "benchmark": "profile_spec_step", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                time.gmtime()),
        "command": "python " + " ".join(sys.argv), "model": a.model or "smollm2-shape random",
        "requests": a.requests, "depth": a.depth, "max_tokens": a.max_tokens,
        "plain": {"seconds": plain_s, "tokens": plain_tokens,
                  "ms_per_step": 1e3 * plain_s / plain_steps},
        "spec": {"seconds": spec_s, "tokens": spec_tokens, "steps": spec_steps,
                 "ms_per_step": 1e3 * spec_s / max(spec_steps, 1),
                 "profiled_host_s": sum(t["tottime_s"] for t in top)},
        "top_host_functions": top, "machine": machine_info(a.device),
    }
    print(buf.getvalue())
    print(f"plain: {res['plain']['ms_per_step']:.2f} ms/step; speculative: "
          f"{res['spec']['ms_per_step']:.2f} ms/step ({spec_steps:.0f} steps, "
          f"{spec_tokens} tokens)")
    save_json(res, a.out)


if __name__ == "__main__":
    main()
