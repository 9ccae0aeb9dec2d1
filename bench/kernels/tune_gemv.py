"""Tune the small-batch GEMV (skyline/ops/gemv.py) on this GPU against cuBLAS and the copy
bandwidth measured in the same run.

  python bench/kernels/tune_gemv.py      # llama-3.1-8b and qwen3-8b shapes, rows 1,2,4,8
  python bench/kernels/tune_gemv.py --models llama-3.1-8b --rows 1 --report /tmp/gemv.json

For each Linear shape of the shipped configs (qkv, o, gate_up, down, lm_head) and each row count,
every candidate launch configuration is checked against gemv_ref and timed; the fastest goes
into the tuning table (`--configs-out`, default skyline/ops/configs/gemv-<gpu>.json, also
copied to $OUT when set). Timing: one CUDA graph of back-to-back calls (as decode replays them)
cycling over enough copies of the weight that L2 (50 MB on an H200) cannot serve it; the same
for cuBLAS `F.linear`. Bandwidth fraction = weight bytes / time / copy bandwidth (read + write
bytes of a 2 GiB device-to-device copy), as in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from skyline.bench.offline import machine_info, save_json
from skyline.configs import dummy_config_dir
from skyline.ops.gemv import KERNEL, config_key, default_config, gemv, gemv_ref
from skyline.ops.tuning import CONFIG_DIR, write_configs

ROTATE_BYTES = 256 << 20  # weight copies per shape add up to at least this (5x an H200's L2)
REPLAY_S = 2e-3  # target length of one timed graph replay


def copy_bandwidth(elements: int = 2**30) -> float:
    """Bytes read + written per second by a device-to-device copy of `elements` bf16 values
    (2 GiB by default), median of 20 after 3 warm-ups."""
    x = torch.randn(elements, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    times = []
    for i in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * elements * 2 / sorted(times)[len(times) // 2]


def linear_shapes(models: list[str]) -> dict[tuple[int, int], list[str]]:
    """{(N, K): ["llama-3.1-8b.qkv", ...]} over the models' Linear layers and LM head."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in models:
        folder = dummy_config_dir(model)
        if folder is None:
            raise SystemExit(f"no shipped config called {model!r}; see skyline/configs/")
        c = json.loads((Path(folder) / "config.json").read_text())
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        kv_heads, inter = c["num_key_value_heads"], c["intermediate_size"]
        head_dim = c.get("head_dim") or hidden // heads
        layers = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
                  "o": (hidden, heads * head_dim), "gate_up": (2 * inter, hidden),
                  "down": (hidden, inter), "lm_head": (c["vocab_size"], hidden)}
        for name, nk in layers.items():
            shapes.setdefault(nk, []).append(f"{model}.{name}")
    return shapes


def candidates(m: int, n: int, k: int, num_sms: int) -> list[dict[str, Any]]:
    """Launch configurations worth timing for an [m, k] x [n, k]^T product.

    FMA tiles for up to four rows (each thread keeps at most 64 fp32 accumulators; beyond four
    rows the repeated x loads cost more than tensor cores), tensor-core tiles for every m; split K
    from 1 up to ~16 waves of programs, keeping at least max(2, num_stages) K tiles per split.
    Unpipelined tiles (num_stages 1) are also tried with PREFETCH (the next W tile loaded into
    registers a step ahead) where the splits' K tiles are whole.
    """
    tiles: list[tuple[bool, int, int, int, int]] = []  # (dot, BLOCK_N, BLOCK_K, warps, stages)
    if m <= 4:
        for bn, bk, warps in [(16, 256, 4), (32, 256, 4), (8, 512, 4), (16, 512, 4), (8, 256, 2),
                              (4, 512, 4), (4, 1024, 4)]:
            if bn * m * bk // (32 * warps) <= 64:
                tiles += [(False, bn, bk, warps, 1), (False, bn, bk, warps, 3)]
    tiles += [(True, 64, 128, 4, 3), (True, 64, 128, 4, 5), (True, 64, 256, 4, 3),
              (True, 128, 128, 4, 3), (True, 128, 64, 4, 4), (True, 32, 256, 4, 4),
              (True, 64, 128, 4, 1), (True, 64, 256, 4, 1)]
    out, seen = [], set()
    for dot, bn, bk, warps, stages in tiles:
        programs = -(-n // bn)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (k // (split * bk) < max(2, stages)
                              or programs * split > 16 * num_sms):
                break
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "USE_DOT": dot,
                   "num_warps": warps, "num_stages": stages}
            out.append(cfg)
            seen.add(json.dumps(cfg, sort_keys=True))
            if stages == 1 and k % (split * bk) == 0:  # the next W tile loaded a step ahead
                out.append({**cfg, "PREFETCH": True})
    base = default_config(m, n, k, num_sms)
    if json.dumps(base, sort_keys=True) not in seen:
        out.append(base)
    return out


def time_calls(fns: list, calls: int) -> float:
    """Seconds per call: `calls` calls cycling over `fns`, captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del graph
    return sorted(times)[len(times) // 2] / calls


def tune_shape(n: int, k: int, rows: list[int], copy_bw: float, num_sms: int,
               dtype: torch.dtype) -> list[dict[str, Any]]:
    nbytes = n * k * dtype.itemsize
    num_copies = max(1, math.ceil(ROTATE_BYTES / nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(num_copies)]
    calls = num_copies * max(1, round(REPLAY_S * 4e12 / nbytes / num_copies))
    calls = min(calls, 512)
    frac = lambda t: nbytes / t / copy_bw  # noqa: E731
    results = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = gemv_ref(x, weights[0]).float()
        tol = 1e-2 * ref.abs().max().item() + 1e-3
        t_cublas = time_calls([lambda w=w, x=x: F.linear(x, w) for w in weights], calls)
        timed, failed = [], []
        for cfg in candidates(m, n, k, num_sms):
            try:
                err = (gemv(x, weights[0], config=cfg).float() - ref).abs().max().item()
                if not err <= tol:
                    raise AssertionError(f"max error {err:.3g} > {tol:.3g}")
                t = time_calls([lambda w=w, x=x, c=cfg: gemv(x, w, config=c) for w in weights],
                               calls)
            except Exception as e:  # a config the GPU cannot run (e.g. too much shared memory)
                failed.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            timed.append((t, cfg))
        if not timed:
            raise SystemExit(f"no GEMV config ran for {n}x{k}, m={m}: {failed[:2]}")
        timed.sort(key=lambda tc: tc[0])
        t_best, best = timed[0]
        base = default_config(m, n, k, num_sms)
        t_default = next((t for t, c in timed if c == base), None)
        res = {
            "N": n, "K": k, "rows": m, "key": config_key(m, n, k), "weight_MB": nbytes / 1e6,
            "cublas_us": t_cublas * 1e6, "cublas_frac": frac(t_cublas),
            "gemv_us": t_best * 1e6, "gemv_frac": frac(t_best),
            "speedup_vs_cublas": t_cublas / t_best, "config": best,
            "default_us": None if t_default is None else t_default * 1e6,
            "default_frac": None if t_default is None else frac(t_default),
            "top5": [{"us": t * 1e6, "frac": frac(t), "config": c} for t, c in timed[:5]],
            "num_timed": len(timed), "failed": failed,
        }
        results.append(res)
        print(f"{n:>6}x{k:<6} m={m}  cuBLAS {res['cublas_us']:7.1f} us ({res['cublas_frac']:.2f})"
              f"  gemv {res['gemv_us']:7.1f} us ({res['gemv_frac']:.2f})  "
              f"{res['speedup_vs_cublas']:.2f}x  {best}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return results


def step_summary(shapes: dict[tuple[int, int], list[str]], results: list[dict[str, Any]],
                 models: list[str], copy_bw: float) -> dict[str, Any]:
    """Per model and row count: the Linear layers of one decode step (not the LM head, which
    does not go through the GEMV), cuBLAS against the tuned GEMV, as a bandwidth fraction."""
    by = {(r["N"], r["K"], r["rows"]): r for r in results}
    out: dict[str, Any] = {}
    for model in models:
        num_layers = json.loads(
            (Path(dummy_config_dir(model)) / "config.json").read_text())["num_hidden_layers"]
        mine = [nk for nk, names in shapes.items()
                for name in names if name.startswith(model + ".") and not name.endswith("lm_head")]
        for m in sorted({r["rows"] for r in results}):
            rs = [by[(n, k, m)] for n, k in mine]
            nbytes = num_layers * sum(r["weight_MB"] * 1e6 for r in rs)
            t_cublas = num_layers * sum(r["cublas_us"] for r in rs) / 1e6
            t_gemv = num_layers * sum(r["gemv_us"] for r in rs) / 1e6
            out[f"{model}:m{m}"] = {
                "layers_weight_GB": nbytes / 1e9, "cublas_ms": t_cublas * 1e3,
                "gemv_ms": t_gemv * 1e3, "cublas_frac": nbytes / t_cublas / copy_bw,
                "gemv_frac": nbytes / t_gemv / copy_bw}
    return out


def copy_to_out(path: str) -> None:
    """A copy of `path` under $OUT (the GPU machine hands back only what is there), unless it
    is already there."""
    if os.environ.get("OUT"):
        copy = Path(os.environ["OUT"]) / Path(path).name
        if copy.resolve() != Path(path).resolve():
            shutil.copy(path, copy)


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200"."""
    return name.lower().removeprefix("nvidia").strip().replace(" ", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-8b"])
    ap.add_argument("--rows", nargs="+", type=int, choices=[1, 2, 4, 8], default=[1, 2, 4, 8],
                    help="row counts to tune (each covers the counts up to it)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--configs-out", default=None,
                    help="tuning table to merge into (default skyline/ops/configs/gemv-<gpu>.json)")
    ap.add_argument("--report", default=None,
                    help="JSON report (default $OUT/gemv-tune-<gpu>.json, else "
                         "bench/results/kernels/)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_gemv needs a CUDA GPU; run it on the GPU machine.")
    t0 = time.time()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    name = torch.cuda.get_device_name(0)
    slug = device_slug(name)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth()
    print(f"{name}: copy bandwidth (read + write) {copy_bw / 1e12:.2f} TB/s, {num_sms} SMs")
    shapes = linear_shapes(a.models)
    results = []
    for (n, k), names in shapes.items():
        print(f"{n}x{k}: {', '.join(names)}", flush=True)
        for r in tune_shape(n, k, a.rows, copy_bw, num_sms, dtype):
            r["layers"] = names
            results.append(r)
    command = "python " + " ".join(sys.argv)
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    configs_out = a.configs_out or str(CONFIG_DIR / f"gemv-{slug}.json")
    write_configs(configs_out, name, {KERNEL: {r["key"]: r["config"] for r in results}},
                  meta={"date": date, "command": command, "torch": torch.__version__,
                        "triton": _triton_version(), "dtype": a.dtype})
    print(f"wrote {configs_out}")
    copy_to_out(configs_out)
    report = {
        "benchmark": "tune_gemv", "date": date, "command": command, "device": name,
        "dtype": a.dtype, "copy_bandwidth_TBps": copy_bw / 1e12, "num_sms": num_sms,
        "rotate_bytes": ROTATE_BYTES, "wall_s": time.time() - t0,
        "decode_step_linears": step_summary(shapes, results, a.models, copy_bw),
        "shapes": results, "machine": machine_info("cuda"),
    }
    out_dir = os.environ.get("OUT") or "bench/results/kernels"
    save_json(report, a.report or os.path.join(out_dir, f"gemv-tune-{slug}.json"))
    for key, s in report["decode_step_linears"].items():
        print(f"{key}: decode-step linears {s['layers_weight_GB']:.2f} GB  cuBLAS "
              f"{s['cublas_ms']:.2f} ms ({s['cublas_frac']:.2f})  gemv {s['gemv_ms']:.2f} ms "
              f"({s['gemv_frac']:.2f})")
    print(f"done in {time.time() - t0:.0f} s")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
