"""Time from nothing to an engine ready to serve an 8B model on one GPU, by phase.

  python bench/fast_start.py --model llama-3.1-8b --dir /tmp/llama-8b-ckpt
  python bench/fast_start.py --smoke   # a tiny random model on the CPU: the code only

First writes a bf16 safetensors checkpoint of the model's shape (random weights, Hugging Face
tensor names, 5 GB shards) unless `--dir` already holds one, then builds the engine from it the
way `skyline serve` does and reports: weight loading, the profiling forward pass and KV cache
allocation, CUDA graph capture, and the total. The checkpoint was just written, so it is read
from the page cache (a warm restart); a cold start adds the disk's read time for its size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import save_file

from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.config import ModelArch
from skyline.configs import dummy_config_dir
from skyline.engine.frontend.llm import LLM


def hf_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
    h, kv, hd = a.hidden_size, a.num_kv_heads * a.head_dim, a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, h)
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (a.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, a.num_heads * hd),
            p + "mlp.gate_proj.weight": (a.intermediate_size, h),
            p + "mlp.up_proj.weight": (a.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, a.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
        if a.architecture == "Qwen3ForCausalLM":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def write_checkpoint(model: str, out: str, device: str, shard_bytes: int = 5 << 30) -> float:
    src = dummy_config_dir(model) or model
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), out)
    with open(os.path.join(out, "config.json")) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    t0 = time.perf_counter()
    shard: dict[str, torch.Tensor] = {}
    size, n = 0, 0
    gen = torch.Generator(device=device).manual_seed(0)
    for name, shape in hf_shapes(arch).items():
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        t.normal_(0, 0.02, generator=gen) if len(shape) == 2 else t.fill_(1.0)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size >= shard_bytes:
            save_file(shard, os.path.join(out, f"model-{n:05d}.safetensors"))
            shard, size, n = {}, 0, n + 1
    if shard:
        save_file(shard, os.path.join(out, f"model-{n:05d}.safetensors"))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--dir", default="/tmp/skyline-fast-start")
    ap.add_argument("--out", default=None)
    ap.add_argument("--speculative-method", default="none",
                    help="ngram/suffix/...: also captures the verification-step graphs")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model's checkpoint, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("fast_start", a.smoke)
    if a.smoke:
        a.model, a.dir = tiny_model(), tempfile.mkdtemp(prefix="skyline-smoke-")
    write_s = None
    if not os.path.isdir(a.dir) or not any(f.endswith(".safetensors") for f in os.listdir(a.dir)):
        write_s = write_checkpoint(a.model, a.dir, device)
    ckpt_gb = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir)) / 1e9
    t0 = time.perf_counter()
    llm = LLM(a.dir, max_model_len=8192, speculative_method=a.speculative_method,
              device=device, **({"kv_cache_memory": "64MiB"} if a.smoke else {}))
    total = time.perf_counter() - t0
    info = llm.query("describe")
    res = {
        "benchmark": "fast_start", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": a.model, "speculative_method": a.speculative_method, "checkpoint_GB": ckpt_gb,
        "checkpoint_write_s": write_s,
        "load_weights_s": info["load_seconds"],
        "cuda_graph_capture_s": info["cuda_graph_capture_seconds"],
        "num_cuda_graphs": info["num_cuda_graphs"],
        "num_mixed_cuda_graphs": info["num_mixed_cuda_graphs"],
        "engine_ready_s": total, "load_GBps": ckpt_gb / info["load_seconds"],
        "machine": machine_info(device),
    }
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
