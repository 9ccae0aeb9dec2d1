"""Mixture-of-experts models against their floors, each measured in the same run: the MoE MLP
alone at decode sizes (the decode GEMVs of ops/moe_gemv.py against the grouped GEMMs, in CUDA
graphs: bench/kernels/moe_gemv_speed.py), batch-1 decode against the bandwidth roofline of the
bytes one token reads (dense weights, the experts it is routed to, its KV), and an offline run
against the sequential and overlapped floors of skyline/bench/floor.py (the experts each decode
step reads, expected over uniform routing), with the KV cache the engine got (and the terms of
its budget) and the preemptions it caused. Every stage runs on one GPU; models run one after
the other, each engine released before the next one sizes its cache.

With --n-cpu-moe N [N ...], decode runs once per N with the experts of the first N layers in
host memory, run by the CPU (the GPU capped by --gpu-memory-utilization, so that the model
need not fit), against a floor of two parts measured in the same run: the bytes a token reads
on the GPU over the GPU's copy bandwidth, plus the host experts' bytes it reads over the host
memory's. An N with which the model does not fit records the engine's sentence instead.

  python bench/moe.py                                   # every stage, both models, this GPU
  python bench/moe.py --stages decode --models gpt-oss-20b
  python bench/moe.py --stages decode --models qwen3-30b-a3b --n-cpu-moe 0 16 24 32 \
      --gpu-memory-utilization 0.3                      # experts partly on the CPU
  python bench/moe.py --smoke --out-dir /tmp/moe        # CPU, shrunken configs, seconds

Models are shipped config names (dummy weights): qwen3-30b-a3b in bf16, gpt-oss-20b with its
experts in MXFP4 as the checkpoint ships them.
JSON: <out-dir>/{decode,offline}-<model>-<device>.json, <out-dir>/{kernel,grouped}-<device>.json;
decode-<model>-<device>-cpu-moe-<N>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from skyline.bench.floor import copy_bandwidth
from skyline.bench.offline import machine_info, random_prompts, run_offline, save_json
from skyline.config import ConfigError
from skyline.configs import dummy_config_dir
from skyline.engine.args import EngineArgs
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams

MODELS = ("qwen3-30b-a3b", "gpt-oss-20b")
# --smoke: each shipped config shrunk to a model a CPU runs in seconds
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=16, num_local_experts=16, max_position_embeddings=4096)


def smoke_config(name: str, root: Path) -> str:
    """A directory holding `name`'s shipped config.json with SMOKE's sizes."""
    cfg = json.loads((Path(dummy_config_dir(name)) / "config.json").read_text())
    cfg.update({k: v for k, v in SMOKE.items() if k in cfg})
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def release(llm: LLM) -> None:
    """Hand the engine's memory back before the next model loads (shutdown lets go of its
    weights, cache and graphs even while the caller still holds the LLM)."""
    llm.shutdown()
    collect()


def collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode(args: EngineArgs, name: str, prompt_len: int, new_tokens: int,
           host_elements: int | None = None) -> dict[str, Any]:
    """Batch-1 decode tok/s against bandwidth / (bytes one token reads); with experts on the
    CPU (args.n_cpu_moe), against the GPU's bytes over its bandwidth plus the host experts'
    bytes over the host memory's."""
    device = torch.device("cuda" if args.device.startswith("cuda") else "cpu")
    bandwidth = copy_bandwidth(device)
    # host memory, not a cache: a buffer larger than any CPU's last-level cache
    host_bandwidth = copy_bandwidth(torch.device("cpu"), host_elements) \
        if args.n_cpu_moe else None
    llm = LLM(**dataclasses.asdict(args) | dict(max_model_len=prompt_len + new_tokens + 16,
                                                max_num_seqs=8))
    cfg = llm.config
    cost = llm.query("model_cost")
    mean_ctx = prompt_len + new_tokens / 2
    bytes_per_token = cost.step_weight_bytes(1) + cost.kv_bytes_per_token * mean_ctx
    # batch 1: each layer's top-k experts, a fraction of every layer's
    host_bytes = cost.host_expert_bytes * cost.expert_fraction
    device_seconds = (bytes_per_token - host_bytes) / bandwidth
    host_seconds = host_bytes / host_bandwidth if host_bandwidth else 0.0
    roofline = 1 / (device_seconds + host_seconds)
    prompt = random_prompts(1, prompt_len, cfg.model.arch.vocab_size)[0]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], dataclasses.replace(params, max_tokens=8))  # warm-up

    def rate() -> float:
        # first to last token as the caller receives them (no syncs of our own)
        stamps = [time.perf_counter() for _ in llm.stream(prompt, params)]
        return (new_tokens - 1) / (stamps[-1] - stamps[0])

    tok_s = max(rate() for _ in range(2))
    memory = {k: v for k, v in llm.query("describe").items() if k.endswith("_gib")}
    res = {
        "benchmark": "moe_decode", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": name, "device": cfg.device, "dtype": cfg.model.dtype,
        "quantization": cfg.model.quant.method, "experts": cfg.model.quant.experts or
        cfg.model.quant.method, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "cuda_graphs": cfg.device.startswith("cuda") and not cfg.enforce_eager,
        "n_cpu_moe": cfg.parallel.n_cpu_moe,
        "gpu_memory_utilization": cfg.cache.gpu_memory_utilization,
        "host_bandwidth_GBps": host_bandwidth / 1e9 if host_bandwidth else None,
        "device_bytes_per_token_GB": (bytes_per_token - host_bytes) / 1e9,
        "host_bytes_per_token_GB": host_bytes / 1e9,
        "host_experts_GB": cost.host_expert_bytes / 1e9,
        "floor_device_ms": device_seconds * 1e3, "floor_host_ms": host_seconds * 1e3,
        "copy_bandwidth_TBps": bandwidth / 1e12, "cost": dataclasses.asdict(cost),
        "active_weight_GB": cost.step_weight_bytes(1) / 1e9,
        "all_experts_GB": cost.expert_bytes / 1e9, "bytes_per_token_GB": bytes_per_token / 1e9,
        "roofline_tok_s": roofline, "decode_tok_s": tok_s, "fraction_of_roofline":
        tok_s / roofline, "memory": memory, "machine": machine_info(cfg.device),
    }
    print(f"{name} batch-1 decode: {tok_s:.1f} tok/s, roofline {roofline:.1f} tok/s "
          f"({res['bytes_per_token_GB']:.2f} GB a token at {bandwidth / 1e12:.2f} TB/s): "
          f"fraction {res['fraction_of_roofline']:.2f}")
    if host_bandwidth:
        print(f"  --n-cpu-moe {cfg.parallel.n_cpu_moe}: {host_bytes / 1e9:.3f} GB a token from "
              f"host memory at {host_bandwidth / 1e9:.1f} GB/s ({host_seconds * 1e3:.2f} ms) "
              f"+ {(bytes_per_token - host_bytes) / 1e9:.3f} GB on the GPU "
              f"({device_seconds * 1e3:.2f} ms)")
    release(llm)
    return res


def offline_summary(name: str, res: dict[str, Any]) -> None:
    """The offline run's headline: throughput, the KV cache it got and what that cost."""
    eng, floor = res["engine"], res.get("floor", {})
    print(f"{name} offline: {res['skyline']['output_tokens_per_s']:.0f} output tok/s, KV cache "
          f"{eng['kv_cache_gib']:.1f} GiB ({eng['kv_cache_tokens']} tokens; in use before it "
          f"{eng.get('memory_in_use_gib', 0):.1f} GiB, step peak "
          f"{eng.get('profile_peak_gib', 0):.1f} GiB), {eng['num_preemptions']} preemptions, "
          f"fraction of the sequential floor {floor.get('fraction_of_sequential', 0):.2f} at "
          f"{floor.get('concurrency', 0)} sequences")


def kernel(out: Path, smoke: bool) -> None:
    """The MoE MLP alone (its own processes: their weights are gone before an engine sizes its
    cache): the decode GEMVs at 1..8 tokens against the grouped GEMMs, and the grouped GEMMs
    at prefill sizes against their floor."""
    tag = "smoke" if smoke else "cuda"
    for name, report in (("moe_gemv_speed.py", f"kernel-{tag}.json"),
                         ("moe_grouped_speed.py", f"grouped-{tag}.json")):
        script = Path(__file__).resolve().parent / "kernels" / name
        cmd = [sys.executable, str(script), "--out", str(out / report)]
        subprocess.run(cmd + (["--smoke", "--tune"] if smoke else []), check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", default=["kernel", "decode", "offline"],
                    choices=["kernel", "decode", "offline"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt-len", type=int, default=512, help="decode: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="decode: tokens generated")
    ap.add_argument("--num-prompts", type=int, default=1000, help="offline")
    ap.add_argument("--input-len", type=int, default=1000, help="offline")
    ap.add_argument("--output-len", type=int, default=1000, help="offline")
    ap.add_argument("--max-num-seqs", type=lambda v: v if v == "auto" else int(v),
                    default="auto", help="offline: N, or auto (from the KV cache's size)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--n-cpu-moe", type=int, nargs="+", default=None, metavar="N",
                    help="decode: one run per N, the first N layers' experts on the CPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out-dir", default="bench/results/moe")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, the configs shrunk, a few tokens: checks the script runs")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory() if a.smoke else None
    if a.smoke:
        a.device, a.prompt_len, a.new_tokens = "cpu", 16, 8
        a.num_prompts, a.input_len, a.output_len, a.max_num_seqs = 4, 8, 4, 4
    out = Path(a.out_dir)
    if "kernel" in a.stages:
        kernel(out, a.smoke)
    for name in a.models:
        path = smoke_config(name, Path(tmp.name)) if tmp is not None else name
        args = EngineArgs(model=path, load_format="dummy", device=a.device,
                          kv_cache_dtype=a.kv_cache_dtype, enforce_eager=a.enforce_eager)
        tag = f"{name}-{'smoke' if a.smoke else a.device}"
        if "decode" in a.stages and a.n_cpu_moe is not None:
            for n in a.n_cpu_moe:
                path_n = str(out / f"decode-{tag}-cpu-moe-{n}.json")
                run = dataclasses.replace(args, n_cpu_moe=n,
                                          gpu_memory_utilization=a.gpu_memory_utilization)
                try:
                    res = decode(run, name, a.prompt_len, a.new_tokens,
                                 2**20 if a.smoke else 2**29)
                except ConfigError as e:  # does not fit with this N: say so, go on
                    print(f"{name} --n-cpu-moe {n}: {e}")
                    res = {"benchmark": "moe_decode", "model": name, "n_cpu_moe": n,
                           "gpu_memory_utilization": a.gpu_memory_utilization,
                           "error": str(e)}
                # after the except block: its exception holds the half-built engine's frames
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                save_json(res, path_n)
        elif "decode" in a.stages:
            res = decode(args, name, a.prompt_len, a.new_tokens)
            save_json(res, str(out / f"decode-{tag}.json"))
            collect()
        if "offline" in a.stages:
            args = dataclasses.replace(args, max_num_seqs=a.max_num_seqs,
                                       max_model_len=a.input_len + a.output_len + 16)
            res = run_offline(args, a.num_prompts, a.input_len, a.output_len,
                              str(out / f"offline-{tag}.json"), floor=True)
            offline_summary(name, res)
            collect()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
