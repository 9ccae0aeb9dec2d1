"""Offline throughput of skyline against Hugging Face transformers `generate`, in one run.

Same model, same random prompts, same output length (EOS ignored), same device and dtype.

  CPU, default model:  python bench/offline_vs_hf.py --num-prompts 32 --input-len 128 \
                           --output-len 64 --out bench/results/offline/offline-cpu-smollm2.json
  H200, 8B dummy:      python bench/offline_vs_hf.py --model llama-3.1-8b --load-format dummy \
                           --num-prompts 256 --input-len 512 --output-len 256 --out ...
  smoke:               python bench/offline_vs_hf.py --smoke   # a tiny random model: the code
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time

import torch

from skyline.bench.offline import machine_info, measure, random_prompts, save_json
from skyline.bench.smoke import tiny_model
from skyline.engine.args import EngineArgs
from skyline.engine.frontend.llm import LLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_model(cfg, device: str):
    """The same architecture in transformers: real weights from the GGUF/HF files, or random
    weights from the config for dummy runs."""
    import transformers

    dtype = DTYPES[cfg.model.dtype]
    path = cfg.model.path
    if cfg.model.load_format == "gguf":
        d, f = os.path.split(path)
        m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    elif cfg.model.load_format == "safetensors":
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        hf_cfg = transformers.AutoConfig.from_pretrained(path)
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return m.to(device).eval()


@torch.inference_mode()
def measure_hf(model, prompts: list[list[int]], output_len: int, batch_size: int,
               device: str) -> dict:
    pad = 0

    def run(batch: list[list[int]], n: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    run(prompts[:1], 4)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    n_out = sum(run(prompts[i:i + batch_size], output_len)
                for i in range(0, len(prompts), batch_size))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    return {"elapsed_s": dt, "requests_per_s": len(prompts) / dt,
            "output_tokens_per_s": n_out / dt, "total_tokens_per_s": (n_in + n_out) / dt,
            "batch_size": batch_size, "num_output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    ap.add_argument("--hf-batch-size", type=int, default=None,
                    help="HF generate batch size (default: all prompts at once)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model on the CPU, 2 prompts of 16 + 4 tokens")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.load_format, a.device = tiny_model(), "dummy", "cpu"
        a.num_prompts, a.input_len, a.output_len, a.out = 2, 16, 4, None

    args = EngineArgs(model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device,
                      max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                      max_model_len=a.input_len + a.output_len + 16,
                      kv_cache_dtype=a.kv_cache_dtype)
    llm = LLM(**dataclasses.asdict(args))
    cfg = llm.config
    prompts = random_prompts(a.num_prompts, a.input_len, cfg.model.arch.vocab_size)
    sky = measure(llm, prompts, a.output_len)
    print(f"skyline: {sky['output_tokens_per_s']:.1f} output tok/s "
          f"({sky['requests_per_s']:.2f} req/s)", flush=True)
    result = {
        "benchmark": "offline_vs_hf", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": cfg.model.name, "load_format": cfg.model.load_format, "dtype": cfg.model.dtype,
        "device": cfg.device, "num_prompts": a.num_prompts, "input_len": a.input_len,
        "output_len": a.output_len, "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "kv_cache_dtype": cfg.cache.kv_cache_dtype,
        "machine": machine_info(cfg.device), "skyline": sky,
    }
    del llm
    gc.collect()
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if not a.skip_hf:
        model = hf_model(cfg, cfg.device)
        hf = measure_hf(model, prompts, a.output_len, a.hf_batch_size or a.num_prompts,
                        cfg.device)
        result["hf_transformers"] = hf
        result["speedup_vs_hf"] = sky["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(f"transformers generate: {hf['output_tokens_per_s']:.1f} output tok/s; "
              f"skyline/hf = {result['speedup_vs_hf']:.2f}x", flush=True)
    save_json(result, a.out)


if __name__ == "__main__":
    main()
