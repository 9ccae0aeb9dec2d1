"""Tune the fused elementwise kernels (RMSNorm, residual-add + RMSNorm, rotary, q/k-norm + rotary,
SiLU-and-mul) on this GPU for the shapes of the shipped model configs, and write the winners as
data for skyline/ops/tuning.py; also time each against its PyTorch reference.

  python bench/kernels/tune_kernels.py --out skyline/ops/configs/h200.json \
      --results bench/results/kernels/kernels-h200.json

Every candidate launch configuration is checked against the reference, then timed as GPU time
per call: a CUDA graph of --calls back-to-back calls, replayed (the way decode steps run), so
host launch cost is excluded for the kernels and the references alike.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from skyline.bench.offline import machine_info, save_json
from skyline.model.layers.rotary import RotaryEmbedding
from skyline.model.loader import read_model_arch
from skyline.ops import activation, norm, rotary, tuning

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def gpu_time(fn: Callable[[], Any], calls: int, replays: int = 5) -> float:
    """Seconds of GPU time per fn() call: median over replays of a graph of `calls` calls."""
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    x = torch.empty(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / gpu_time(lambda: y.copy_(x), calls=5)


def per_thread_ok(elements: int, num_warps: int) -> bool:
    # prune configurations that leave threads idle or spill: 1..64 elements per thread
    return 1 <= elements // (32 * num_warps) <= 64


@dataclass
class Case:
    """One kernel at one shape: fresh inputs, the reference, the kernel under a config, the
    candidate configs, the fallback heuristic's config, and the bytes one call must move."""

    kernel: str
    key: str
    num_tokens: int
    make: Callable[[], tuple]
    ref: Callable
    run: Callable
    candidates: list[dict[str, Any]]
    default: dict[str, Any]
    nbytes: int


def norm_cases(d: int, dtype: torch.dtype, num_tokens: int) -> list[Case]:
    block_n = 1 << (d - 1).bit_length()
    cands = [{"BLOCK_M": m, "num_warps": w} for m in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16)
             if m <= num_tokens and per_thread_ok(m * block_n, w)]
    weight = torch.rand(d, device="cuda", dtype=dtype) + 0.5
    key, default = norm.config_key(d, dtype, num_tokens), norm.default_config(d, num_tokens)
    nbytes = num_tokens * d * dtype.itemsize  # one [T, d] tensor

    def make():
        return (torch.randn(num_tokens, d, device="cuda", dtype=dtype),
                torch.randn(num_tokens, d, device="cuda", dtype=dtype))

    return [
        Case("rms_norm", key, num_tokens, make,
             lambda x, r: norm.rms_norm_ref(x, weight, 1e-6),
             lambda x, r, c: norm.rms_norm_triton(x, weight, 1e-6, c), cands, default,
             2 * nbytes),
        Case("fused_add_rms_norm", key, num_tokens, make,
             lambda x, r: norm.fused_add_rms_norm_ref(x, r, weight, 1e-6),
             lambda x, r, c: norm.fused_add_rms_norm_triton(x, r, weight, 1e-6, c), cands,
             default, 4 * nbytes),
    ]


def rotary_cases(num_heads: int, num_kv_heads: int, head_dim: int, cache: torch.Tensor,
                 qk_norm: bool, dtype: torch.dtype, num_tokens: int) -> list[Case]:
    half_pad = 1 << (head_dim // 2 - 1).bit_length()
    max_heads = 1 << (max(num_heads, num_kv_heads) - 1).bit_length()
    cands = [{"BLOCK_H": h, "num_warps": w} for h in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8)
             if h <= max_heads and per_thread_ok(2 * h * half_pad, w)]
    w = torch.rand(2, head_dim, device="cuda", dtype=dtype) + 0.5
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    key = rotary.config_key(num_heads, num_kv_heads, head_dim, dtype, num_tokens)
    default = rotary.default_config(head_dim, max(num_heads, num_kv_heads))
    nbytes = 2 * num_tokens * (num_heads + num_kv_heads) * head_dim * dtype.itemsize

    def make():
        qkv = torch.randn(num_tokens, sum(sizes), device="cuda", dtype=dtype)
        q, k, _ = qkv.split(sizes, dim=-1)
        pos = torch.randint(0, cache.shape[0], (num_tokens,), device="cuda")
        return (pos, q.unflatten(-1, (num_heads, head_dim)),
                k.unflatten(-1, (num_kv_heads, head_dim)))

    if qk_norm:
        return [Case("qk_norm_rotary", key, num_tokens, make,
                     lambda p, q, k: rotary.qk_norm_rotary_ref(p, q, k, cache, w[0], w[1], 1e-6),
                     lambda p, q, k, c: rotary.rotary_triton(p, q, k, cache, w[0], w[1], 1e-6, c),
                     cands, default, nbytes)]
    return [Case("rotary", key, num_tokens, make,
                 lambda p, q, k: rotary.rotary_embedding_ref(p, q, k, cache),
                 lambda p, q, k, c: rotary.rotary_triton(p, q, k, cache, config=c), cands,
                 default, nbytes)]


def silu_cases(d: int, dtype: torch.dtype, num_tokens: int) -> list[Case]:
    cands = [{"BLOCK": b, "num_warps": w} for b in (256, 512, 1024, 2048, 4096, 8192)
             for w in (1, 2, 4, 8) if b <= max(256, 2 * d) and per_thread_ok(b, w)]
    return [Case("silu_and_mul", activation.config_key(d, dtype, num_tokens), num_tokens,
                 lambda: (torch.randn(num_tokens, 2 * d, device="cuda", dtype=dtype),),
                 activation.silu_and_mul_ref, activation.silu_and_mul_triton, cands,
                 activation.DEFAULT_CONFIG, 3 * num_tokens * d * dtype.itemsize)]


def check(case: Case, config: dict[str, Any]) -> None:
    args = case.make()
    want = case.ref(*args)
    got = case.run(*[a.clone() for a in args], config)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):
        err = ((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item()
        if not err < 2e-2:
            sys.exit(f"{case.kernel} {case.key} {config}: relative error {err:.3g} against the "
                     "reference; the kernel is wrong on this GPU")


def tune(case: Case, calls: int) -> dict[str, Any]:
    args = case.make()
    times = []
    candidates = case.candidates + [case.default] * (case.default not in case.candidates)
    for config in candidates:
        check(case, config)
        times.append((gpu_time(lambda c=config: case.run(*args, c), calls), config))
    best_s, best = min(times, key=lambda t: t[0])
    ref_s = gpu_time(lambda: case.ref(*args), calls)
    default_s = gpu_time(lambda: case.run(*args, case.default), calls)  # untuned fallback
    return {"kernel": case.kernel, "key": case.key, "num_tokens": case.num_tokens,
            "config": best, "us": best_s * 1e6, "default_us": default_s * 1e6,
            "torch_ref_us": ref_s * 1e6, "speedup_vs_torch": ref_s / best_s,
            "gb_per_s": case.nbytes / best_s / 1e9, "candidates": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="configs JSON to write (merged if it exists)")
    ap.add_argument("--results", default=None, help="timings JSON for bench/results/kernels/")
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-8b",
                    help="shipped config names or HF directories")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated: " + ",".join(DTYPES))
    ap.add_argument("--tokens", default=",".join(map(str, tuning.TOKEN_BUCKETS)),
                    help="token counts to tune (the lookup rounds up to these)")
    ap.add_argument("--calls", type=int, default=50, help="calls per timed CUDA graph")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels/tune_kernels.py needs a CUDA GPU; run it on the machine to tune "
                 "for")
    unknown = [d for d in a.dtypes.split(",") if d not in DTYPES]
    if unknown:
        sys.exit(f"unknown dtype(s) {unknown}; use some of {list(DTYPES)}")
    tokens = [int(t) for t in a.tokens.split(",")]
    unbucketed = [t for t in tokens if tuning.token_bucket(t) != t]
    if unbucketed:
        sys.exit(f"token counts {unbucketed} are not lookup buckets {tuning.TOKEN_BUCKETS}")

    cases: dict[tuple[str, str], Case] = {}  # shapes shared by several models are tuned once
    layers = []  # (model, dtype, tokens, the (kernel, key) calls of one decoder layer)
    for name in a.models.split(","):
        arch, _ = read_model_arch(name, "dummy")
        cache = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                arch.rope_scaling).to("cuda").cos_sin_cache
        for dtype_name in a.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for t in tokens:
                norms = norm_cases(arch.hidden_size, dtype, t)
                rope = rotary_cases(arch.num_heads, arch.num_kv_heads, arch.head_dim, cache,
                                    arch.qk_norm, dtype, t)
                silu = silu_cases(arch.intermediate_size, dtype, t)
                for case in norms + rope + silu:
                    cases.setdefault((case.kernel, case.key), case)
                # a decoder layer: two residual-add + norms, rope (with q/k norm), the MLP gate
                calls = [(c.kernel, c.key) for c in (norms[1], norms[1], rope[0], silu[0])]
                layers.append((name, dtype_name, t, calls))

    bandwidth = copy_bandwidth()
    rows, configs = {}, {}
    for (kernel, key), case in sorted(cases.items()):
        row = tune(case, a.calls)
        row["fraction_of_copy_bw"] = row["gb_per_s"] * 1e9 / bandwidth
        rows[kernel, key] = row
        configs.setdefault(kernel, {})[key] = row["config"]
        print(f"{kernel:20s} {key:28s} {row['us']:8.2f} us (default {row['default_us']:8.2f}, "
              f"torch {row['torch_ref_us']:8.2f}) {row['gb_per_s']:7.1f} GB/s  {row['config']}",
              flush=True)
    per_layer = []
    for name, dtype_name, t, calls in layers:
        torch_us = sum(rows[c]["torch_ref_us"] for c in calls)
        fused_us = sum(rows[c]["us"] for c in calls)
        per_layer.append({"model": name, "dtype": dtype_name, "num_tokens": t,
                          "torch_us": torch_us, "fused_us": fused_us,
                          "speedup": torch_us / fused_us})
        print(f"per layer {name} {dtype_name} {t:6d} tokens: torch {torch_us:8.2f} us, "
              f"fused {fused_us:8.2f} us ({torch_us / fused_us:.2f}x)")
    import triton

    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = "python " + " ".join(sys.argv)
    meta = {"date": date, "command": command, "torch": torch.__version__,
            "triton": triton.__version__, "models": a.models}
    tuning.write_configs(a.out, torch.cuda.get_device_name(), configs, meta)
    print(f"wrote {a.out}")
    save_json({"benchmark": "kernel_tuning", "date": date, "command": command,
               "machine": machine_info("cuda"), "copy_bandwidth_gb_per_s": bandwidth / 1e9,
               "models": a.models, "per_layer": per_layer, "results": list(rows.values())},
              a.results)


if __name__ == "__main__":
    main()
