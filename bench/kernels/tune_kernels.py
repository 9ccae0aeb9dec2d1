"""Tune the fused elementwise kernels (RMSNorm, residual-add + RMSNorm, rotary, q/k-norm + rotary,
SiLU-and-mul) on this GPU for the shapes of the shipped model configs, and write the winners as
data for skyline/ops/tuning.py; also time each against its PyTorch reference.

  python bench/kernels/tune_kernels.py --out skyline/ops/configs/h200.json \
      --results bench/results/kernels/kernels-h200.json
  python bench/kernels/tune_kernels.py --smoke   # seconds, on the CPU (skyline/bench/tuners.py)

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

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.bench.tuners import (  # noqa: E402
    device_bandwidth,
    model_arch,
    time_calls,
    triton_version,
    tune_device,
)
from skyline.config import ModelArch  # noqa: E402
from skyline.ops import activation, norm, rotary, tuning  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SMOKE_ARCH = ModelArch("LlamaForCausalLM", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, max_position_embeddings=64)


def gpu_time(fn: Callable[[], Any], calls: int) -> float:
    """Seconds of GPU time per fn() call (a graph of `calls` calls, replayed)."""
    return time_calls([fn], calls)


def cos_sin_table(arch: ModelArch, device: torch.device) -> torch.Tensor:
    """[max_position_embeddings, head_dim] cos | sin of the plain rotary frequencies: values
    of the table the kernels read (the tuned speed does not depend on a scaling's exact
    frequencies)."""
    half = torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim
    inv_freq = 1.0 / arch.rope_theta**half
    angles = torch.arange(arch.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


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


def norm_cases(d: int, dtype: torch.dtype, num_tokens: int, device: torch.device
               ) -> list[Case]:
    block_n = 1 << (d - 1).bit_length()
    cands = [{"BLOCK_M": m, "num_warps": w} for m in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16)
             if m <= num_tokens and per_thread_ok(m * block_n, w)]
    weight = torch.rand(d, device=device, dtype=dtype) + 0.5
    key, default = norm.config_key(d, dtype, num_tokens), norm.default_config(d, num_tokens)
    nbytes = num_tokens * d * dtype.itemsize  # one [T, d] tensor

    def make():
        return (torch.randn(num_tokens, d, device=device, dtype=dtype),
                torch.randn(num_tokens, d, device=device, dtype=dtype))

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
    device = cache.device
    w = torch.rand(2, head_dim, device=device, dtype=dtype) + 0.5
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    key = rotary.config_key(num_heads, num_kv_heads, head_dim, dtype, num_tokens)
    default = rotary.default_config(head_dim, max(num_heads, num_kv_heads))
    nbytes = 2 * num_tokens * (num_heads + num_kv_heads) * head_dim * dtype.itemsize

    def make():
        qkv = torch.randn(num_tokens, sum(sizes), device=device, dtype=dtype)
        q, k, _ = qkv.split(sizes, dim=-1)
        pos = torch.randint(0, cache.shape[0], (num_tokens,), device=device)
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


def silu_cases(d: int, dtype: torch.dtype, num_tokens: int, device: torch.device
               ) -> list[Case]:
    cands = [{"BLOCK": b, "num_warps": w} for b in (256, 512, 1024, 2048, 4096, 8192)
             for w in (1, 2, 4, 8) if b <= max(256, 2 * d) and per_thread_ok(b, w)]
    return [Case("silu_and_mul", activation.config_key(d, dtype, num_tokens), num_tokens,
                 lambda: (torch.randn(num_tokens, 2 * d, device=device, dtype=dtype),),
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


def tune(case: Case, calls: int, smoke: bool) -> dict[str, Any]:
    args = case.make()
    times = []
    candidates = case.candidates[:1] if smoke else case.candidates
    candidates = candidates + [case.default] * (case.default not in candidates)
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
    ap.add_argument("--out", default=None,
                    help="configs JSON to write (merged if it exists); required")
    ap.add_argument("--results", default=None, help="timings JSON for bench/results/kernels/")
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-8b",
                    help="shipped config names or HF directories")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated: " + ",".join(DTYPES))
    ap.add_argument("--tokens", default=",".join(map(str, tuning.TOKEN_BUCKETS)),
                    help="token counts to tune (the lookup rounds up to these)")
    ap.add_argument("--calls", type=int, default=50, help="calls per timed CUDA graph")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, one token count, float32, on the CPU without a GPU")
    a = ap.parse_args()
    if a.out is None and not a.smoke:
        ap.error("--out is required")
    dev = tune_device("tune_kernels", a.smoke)
    if dev.out_dir:
        a.tokens, a.calls, a.models = "1", 1, "smoke"
        a.dtypes = "float32" if dev.device.type == "cpu" else a.dtypes
        a.out = dev.path("configs-smoke.json")
        a.results = dev.path("kernels-smoke.json")
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
        arch = SMOKE_ARCH if dev.out_dir else model_arch(name)
        cache = cos_sin_table(arch, dev.device)
        for dtype_name in a.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            for t in tokens:
                norms = norm_cases(arch.hidden_size, dtype, t, dev.device)
                rope = rotary_cases(arch.num_heads, arch.num_kv_heads, arch.head_dim, cache,
                                    arch.qk_norm, dtype, t)
                silu = silu_cases(arch.intermediate_size, dtype, t, dev.device)
                for case in norms + rope + silu:
                    cases.setdefault((case.kernel, case.key), case)
                # a decoder layer: two residual-add + norms, rope (with q/k norm), the MLP gate
                calls = [(c.kernel, c.key) for c in (norms[1], norms[1], rope[0], silu[0])]
                layers.append((name, dtype_name, t, calls))

    bandwidth = device_bandwidth(dev, 2**29)
    rows, configs = {}, {}
    for (kernel, key), case in sorted(cases.items()):
        row = tune(case, a.calls, dev.out_dir is not None)
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
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = "python " + " ".join(sys.argv)
    meta = {"date": date, "command": command, "torch": torch.__version__,
            "triton": triton_version(), "models": a.models}
    tuning.write_configs(a.out, dev.name, configs, meta)
    print(f"wrote {a.out}")
    save_json({"benchmark": "kernel_tuning", "date": date, "command": command,
               "machine": machine_info(dev.device.type),
               "copy_bandwidth_gb_per_s": bandwidth / 1e9,
               "models": a.models, "per_layer": per_layer, "results": list(rows.values())},
              a.results)


if __name__ == "__main__":
    main()
