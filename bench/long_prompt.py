"""One very long prompt (default 200,000 tokens) through chunked prefill, then again from the KV
tiers: each TTFT against its floor measured in the same run, for each KV cache dtype.

  python bench/long_prompt.py --model llama-3.1-8b --prompt-len 200000 --chunk 8192 \
      --disk-dir /var/tmp/skyline-kv          # the H200 (bench/device.sh, stage long)
  python bench/long_prompt.py --smoke        # CPU, a tiny random model, 256 tokens

Per KV dtype (--kv-cache-dtypes, default auto and fp8):
- cold: the prompt computed. Floor = (linear FLOPs + causal attention FLOPs) / the bf16 matmul
  peak measured here. Linear: 2 * tokens * non-embedding weights. Attention: QK^T and PV over
  the causal triangle, 2 * 2 * layers * heads * head_dim * tokens^2 / 2. The engine writes
  every block to host RAM and disk as it goes (--kv-offload-policy eager).
- ram: the device's prefix cache emptied, the prompt again: its KV comes from pinned host RAM.
  Floor = the prompt's KV bytes / the host-to-device bandwidth measured here.
- disk: a new engine with the disk tier only, the files dropped from the page cache first:
  the KV comes from disk. Floor = the KV bytes / the disk read rate measured here (8 readers
  of 8 MiB pieces of one file, written and dropped from the page cache the same way).
--cold-only measures the cold TTFT alone (no tiers), the engine on 0.9 of the GPU, e.g. once
with every chunk on the paged Triton kernel and once with SKYLINE_DENSE_PREFILL_TOKENS=2048
(long chunks through ops/attention_dense.py), as the long-ab stage of bench/device.sh does.
Beyond the trained context (Llama-3.1: 131,072) the rotary table is extended; with dummy
weights only the speed is meaningful.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from skyline import envs
from skyline.bench.floor import (
    disk_read_rate,
    drop_page_cache,
    host_to_device_bandwidth,
    matmul_peak,
)
from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.engine.frontend.llm import LLM
from skyline.engine.step_trace import StepTrace
from skyline.types import SamplingParams

TWO = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def traced(model: str, trace: StepTrace, **kw: Any) -> LLM:
    """An engine whose steps `trace` sees (each TTFT's steps: their seconds, the host's waits
    and any Triton compilation among them)."""
    llm = LLM(model, **kw, observers=[trace])
    trace.clock = lambda: llm.query("step_clocks")
    return llm


def ttft(llm: LLM, prompt: list[int], trace: StepTrace | None = None
         ) -> tuple[float, list[int]]:
    """Seconds to the first token of `prompt` (and the tokens), the engine idle before;
    `trace` records the steps until that token."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if trace is not None:
        trace.reset()
    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    for delta in llm.stream(prompt, TWO):
        if first is None:
            first = time.perf_counter() - t0
            if trace is not None:
                trace.stop()
        tokens += delta.outputs[0].token_ids
    assert first is not None
    while llm.engine.has_unfinished():  # the tiers' writes in flight end
        llm.step()
    return first, tokens


def steps_of(trace: StepTrace, ttft_s: float) -> dict[str, Any]:
    """Where a TTFT went: its engine steps (count, seconds, Triton compilations among them,
    the slowest) and the seconds outside any step (hashing and admitting the prompt, waiting
    for a tier's copies and reads)."""
    s = trace.summary()
    keep = ("steps", "compiles", "compile_seconds", "compiled_kernels", "slowest_steps")
    seconds = sum(r[3] for r in trace.rows)
    return {k: s[k] for k in keep} | {"seconds": seconds,
                                      "outside_steps_s": max(ttft_s - seconds, 0.0)}


def filesystem(path: str) -> str:
    """The file system type holding `path` (tmpfs would make "disk" reads RAM reads)."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fs = line.split()[:3]
            if os.path.abspath(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def compute_floor(llm: LLM, n: int, peak: float) -> float:
    """Seconds of an n-token prompt's FLOPs at `peak`: its linear layers and causal attention."""
    arch = llm.config.model.arch
    cost = llm.query("model_cost")  # the embedding is a lookup: not counted
    params = cost.linear_params + cost.head_params
    return (2 * n * params + 2 * arch.num_layers * arch.num_heads * arch.head_dim * n * n) / peak


def run_cold(a: argparse.Namespace, kv: str, engine: dict[str, Any], prompt: list[int],
             warm: list[int], peak: float) -> dict[str, Any]:
    """--cold-only: the prompt computed, no tiers, the engine on most of the GPU."""
    trace = StepTrace()
    llm = traced(a.model, trace, **engine, kv_cache_dtype=kv)
    llm.generate([warm], TWO)  # kernel compilation
    cold, tokens = ttft(llm, prompt, trace)
    steps = {"cold": steps_of(trace, cold)}
    floor = compute_floor(llm, len(prompt), peak)
    llm.engine.shutdown()
    return {"kv_cache_dtype": kv, "prompt_len": len(prompt), "cold_ttft_s": cold,
            "compute_floor_s": floor, "cold_over_floor": cold / floor,
            "tokens": {"cold": tokens}, "steps": steps}


def run_kv(a: argparse.Namespace, kv: str, engine: dict[str, Any], prompt: list[int],
           warm: list[int], peak: float, h2d: float, disk_rate: float) -> dict[str, Any]:
    disk = os.path.join(a.disk_dir, f"kv-{kv}")
    shutil.rmtree(disk, ignore_errors=True)
    kw = engine | {"kv_cache_dtype": kv}
    # Half the GPU: the disk stage's engine, made in this process, then has room even if
    # some of this one's memory is slow to go back.
    trace = StepTrace()
    llm = traced(a.model, trace, **kw, kv_offload_ram=a.ram, kv_offload_disk=disk,
                 kv_offload_policy="eager", gpu_memory_utilization=0.45)
    info = llm.query("describe")
    per_token = info["kv_cache_gib"] * 2**30 / info["kv_cache_tokens"]
    llm.generate([warm], TWO)  # kernel compilation
    cold, cold_tokens = ttft(llm, prompt, trace)
    steps = {"cold": steps_of(trace, cold)}
    floor = compute_floor(llm, len(prompt), peak)
    stats = llm.engine.stats()
    stored = stats["kv_offload_disk_stored_blocks"]
    llm.engine.scheduler.kv_manager.reset_prefix_cache()  # the device forgets; RAM keeps it
    ram, ram_tokens = ttft(llm, prompt, trace)
    steps["ram"] = steps_of(trace, ram)
    ram_tokens_loaded = llm.engine.stats()["kv_offload_ram_hit_tokens"] \
        - stats["kv_offload_ram_hit_tokens"]
    llm.engine.shutdown()  # writes in flight end
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    drop_page_cache(glob.glob(os.path.join(disk, "*", "*", "*.kv")))
    llm = traced(a.model, trace, **kw, kv_offload_disk=disk)
    llm.generate([warm[: len(warm) // 2]], TWO)
    before = llm.engine.stats()["kv_offload_disk_hit_tokens"]
    from_disk, disk_tokens = ttft(llm, prompt, trace)
    steps["disk"] = steps_of(trace, from_disk)
    disk_tokens_loaded = llm.engine.stats()["kv_offload_disk_hit_tokens"] - before
    llm.engine.shutdown()
    del llm
    gc.collect()
    shutil.rmtree(disk, ignore_errors=True)
    kv_bytes = ram_tokens_loaded * per_token
    return {
        "kv_cache_dtype": kv, "prompt_len": len(prompt), "kv_bytes_per_token": per_token,
        "cold_ttft_s": cold, "compute_floor_s": floor, "cold_over_floor": cold / floor,
        "disk_blocks_written": stored,
        "ram_tokens_loaded": ram_tokens_loaded, "kv_bytes": kv_bytes,
        "ram_ttft_s": ram, "ram_floor_s": kv_bytes / h2d, "ram_over_floor": ram * h2d / kv_bytes,
        "disk_tokens_loaded": disk_tokens_loaded,
        "disk_ttft_s": from_disk, "disk_floor_s": disk_tokens_loaded * per_token / disk_rate,
        "disk_over_floor": from_disk * disk_rate / max(disk_tokens_loaded * per_token, 1),
        "tokens": {"cold": cold_tokens, "ram": ram_tokens, "disk": disk_tokens},
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-len", type=int, default=200_000)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (token budget)")
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8")
    ap.add_argument("--ram", default="auto", help="--kv-offload-ram (auto: the prompt's KV "
                    "in the model dtype, plus a tenth)")
    ap.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a "
                    "temporary one; put it on the disk to measure, not on tmpfs)")
    ap.add_argument("--disk-rate-bytes", default=4 << 30, type=int,
                    help="size of the file the disk read rate is measured on")
    ap.add_argument("--cold-only", action="store_true",
                    help="the cold TTFT alone (no tiers), the engine on 0.9 of the GPU")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, 256 tokens")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="skyline-long-")
    device = bench_device("long_prompt", a.smoke)
    if a.smoke:
        a.model = tiny_model(tmp)
        a.prompt_len, a.chunk, a.disk_rate_bytes, a.load_format = 256, 64, 32 << 20, "dummy"
    a.disk_dir = a.disk_dir or os.path.join(tmp, "disk")
    os.makedirs(a.disk_dir, exist_ok=True)
    try:
        dev = torch.device(device)
        peak = matmul_peak(dev)
        h2d = 0.0 if a.cold_only else host_to_device_bandwidth(dev)
        disk_rate = 0.0 if a.cold_only else disk_read_rate(a.disk_dir, a.disk_rate_bytes)
        if device == "cuda":
            torch.cuda.empty_cache()
        engine = dict(load_format=a.load_format, max_model_len=a.prompt_len + 64,
                      max_num_batched_tokens=a.chunk, max_num_seqs=4, device=device)
        cfg, _ = create_engine_config(EngineArgs(a.model, load_format=a.load_format,
                                                 device=device))
        arch = cfg.model.arch
        if a.ram == "auto":  # the prompt's KV in the model dtype, and a tenth more
            elem = 4 if cfg.model.dtype == "float32" else 2
            a.ram = int(1.1 * a.prompt_len * 2 * arch.num_layers * arch.num_kv_heads
                        * arch.head_dim * elem)
        vocab = arch.vocab_size
        warm, prompt = random_prompts(2, a.prompt_len, vocab)
        warm = warm[: 2 * a.chunk]
        runs = [run_cold(a, kv, engine, prompt, warm, peak) if a.cold_only
                else run_kv(a, kv, engine, prompt, warm, peak, h2d, disk_rate)
                for kv in a.kv_cache_dtypes.split(",")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {
        "benchmark": "long_prompt", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": "tiny (smoke)" if a.smoke else a.model, "prompt_len": a.prompt_len,
        "chunk": a.chunk, "device": device, "matmul_peak_TFLOPs": peak / 1e12,
        "h2d_GBps": h2d / 1e9, "disk_read_GBps": disk_rate / 1e9,
        "disk_filesystem": filesystem(a.disk_dir), "runs": runs, "machine": machine_info(device),
        "dense_prefill_tokens": envs.ENV.dense_prefill_tokens,
    }
    print_table(res)
    save_json(res, a.out)


def print_table(res: dict[str, Any]) -> None:
    print(f"{res['prompt_len']} tokens, matmul peak {res['matmul_peak_TFLOPs']:.1f} TFLOP/s, "
          f"host-to-device {res['h2d_GBps']:.1f} GB/s, disk {res['disk_read_GBps']:.2f} GB/s "
          f"({res['disk_filesystem']})")
    cols = ("KV", "cold s", "floor s", "x", "KV GB", "RAM s", "floor s", "x", "disk s",
            "floor s", "x")
    print("".join(f"{c:>10}" for c in cols))
    for r in res["runs"]:
        if "ram_ttft_s" not in r:  # --cold-only
            vals = (r["cold_ttft_s"], r["compute_floor_s"], r["cold_over_floor"])
            print(f"{r['kv_cache_dtype']:>10}" + "".join(f"{v:>10.4g}" for v in vals))
            continue
        vals = (r["cold_ttft_s"], r["compute_floor_s"], r["cold_over_floor"],
                r["kv_bytes"] / 1e9, r["ram_ttft_s"], r["ram_floor_s"], r["ram_over_floor"],
                r["disk_ttft_s"], r["disk_floor_s"], r["disk_over_floor"])
        print(f"{r['kv_cache_dtype']:>10}" + "".join(f"{v:>10.4g}" for v in vals))


if __name__ == "__main__":
    main()
