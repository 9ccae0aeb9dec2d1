"""Long-prompt prefill attention: skyline's paged Triton kernel against torch's own SDPA kernels
(cuDNN's and FlashAttention-2) on the same chunk, against the bf16 matmul peak measured in the
same run.

  python bench/kernels/prefill_attention_speed.py                 # GPU: 8,192-token chunks
  python bench/kernels/prefill_attention_speed.py --contexts 8192 65536 --out r.json
  python bench/kernels/prefill_attention_speed.py --smoke         # CPU, interpreter, tiny

One chunk of a long prompt: T new query tokens at the end of a context of C tokens (the first
C - T already in the paged cache, as chunked prefill meets them), Llama-3.1-8B's 32 query and 8
KV heads of 128, bf16, 16-token pages scattered over the cache. Work: 4 * heads * head_dim *
(T * (C - T) + T * (T + 1) / 2) FLOPs (QK^T and PV over what each query sees).

- triton: ops/attention.py's paged_prefill_attention, its launch configuration from the
  tables (or the heuristic), and each --configs entry.
- gather: the context's K and V copied out of the pages into one contiguous [C, KVH, D] pair
  (what any dense kernel needs first).
- dense_extend-<kernel>-seg<S>: ops/attention_dense.py, what the engine runs for long chunks
  (its gather included): torch's cuDNN or FlashAttention-2 kernel over K/V gathered S keys
  at a time, the keys before the chunk (no mask) and the chunk's own (causal, square) merged
  by log-sum-exp, so no kernel needs a bottom-right causal mask; KV heads shared, or
  ("-expand") repeated to every query head first; the backend dense_backend finds also at
  half the segment. A kernel that refuses a shape is recorded as an error.
- cudnn-causal-with-lse (a chunk with no context before it): the one causal cuDNN call with
  its log-sum-exp computed, as dense_extend made it before it skipped that for first chunks.
- flash-lower-right: torch's public SDPA with a bottom-right causal bias
  (torch.nn.attention.bias.causal_lower_right), one call.
Each output is checked against the Triton kernel's (max abs error); a variant's first call on a
new shape is timed apart ("first_call_ms": Triton's compilation, cuDNN's graph building).
--smoke runs the Triton kernel in the interpreter and the math backend in place of cuDNN and
flash.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from skyline.bench.floor import matmul_peak, median_seconds  # noqa: E402
from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.bench.tuners import tune_device  # noqa: E402
from skyline.ops.attention import paged_prefill_attention  # noqa: E402
from skyline.ops.attention_dense import (  # noqa: E402
    SEGMENT,
    attend_lse,
    dense_backend,
    dense_extend,
    gather_kv,
)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def _flops(t: int, c: int) -> float:
    return 4 * HEADS * HEAD_DIM * (t * (c - t) + t * (t + 1) / 2)


def _paged(c: int, t: int, dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """A context of c tokens in scattered pages and the chunk's t queries."""
    g = torch.Generator(device="cpu").manual_seed(c)
    pages = -(-c // PAGE)
    cache = torch.randn(2, pages + 8, PAGE, KV_HEADS, HEAD_DIM, generator=g).to(dev, dtype)
    table = (torch.randperm(pages + 8, generator=g)[:pages]).to(torch.int32)[None].to(dev)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(dev, dtype)
    return {"cache": cache, "table": table, "q": q,
            "qsl": torch.tensor([0, t], dtype=torch.int32, device=dev),
            "lens": torch.tensor([c], dtype=torch.int32, device=dev)}


def _gather(p: dict[str, Any], c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole context, as dense_extend gathers them."""
    return gather_kv(p["cache"], p["table"][0], 0, c, p["q"].dtype)


def _variants(p: dict[str, Any], c: int, t: int, scale: float, smoke: bool
              ) -> dict[str, Callable[[], torch.Tensor]]:
    """dense_extend on each kernel (and each with K/V repeated to every head), the found
    backend also at half the segment, and FlashAttention-2 with a bottom-right causal bias."""
    found = "math" if smoke else dense_backend(p["q"], KV_HEADS)
    backends = ["math"] if smoke else ["cudnn", "cudnn-expand", "flash", "flash-expand"]
    runs = [(b, SEGMENT) for b in backends] + ([(found, SEGMENT // 2)] if found else [])
    out: dict[str, Callable[[], torch.Tensor]] = {
        f"dense_extend-{b}-seg{seg}": lambda b=b, seg=seg: dense_extend(
            p["q"], p["cache"], p["table"][0], c, scale, backend=b, segment=seg)
        for b, seg in runs}
    if not smoke:
        from torch.nn.attention.bias import causal_lower_right

        qh = p["q"].transpose(0, 1)[None]  # [1, H, T, D]
        k, v = _gather(p, c)
        group = HEADS // KV_HEADS
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        if c == t and found == "cudnn":
            out["cudnn-causal-with-lse"] = lambda: attend_lse(
                qh, k, v, True, scale, "cudnn", lse=True)[0]
        bias = causal_lower_right(t, c)
        out["flash-lower-right"] = lambda: F.scaled_dot_product_attention(
            qh, ke, ve, attn_mask=bias, scale=scale)
    return out


def _context(c: int, t: int, configs: list[dict], reps: int, smoke: bool, dev: Any,
             dtype: torch.dtype, peak: float) -> dict[str, Any]:
    """Every variant on one chunk of t queries at the end of a context of c tokens."""
    scale = HEAD_DIM ** -0.5
    p = _paged(c, t, dev.device, dtype)
    flops = _flops(t, c)
    fns = {"triton": lambda: paged_prefill_attention(
        p["q"], p["cache"], p["qsl"], p["lens"], p["table"], scale, t)}
    for cfg in configs:
        name = "triton-" + "-".join(f"{k}{v}" for k, v in cfg.items())
        fns[name] = lambda cfg=cfg: paged_prefill_attention(
            p["q"], p["cache"], p["qsl"], p["lens"], p["table"], scale, t, config=cfg)
    k, _ = _gather(p, c)
    timed: dict[str, Any] = {"gather": {
        "ms": median_seconds(lambda: _gather(p, c), dev.device, reps) * 1e3,
        "GB": 2 * k.numel() * k.element_size() / 1e9}}
    del k
    fns.update(_variants(p, c, t, scale, smoke))
    ref = None
    for name, fn in fns.items():
        try:
            t0 = time.perf_counter()
            o = fn()
            if dev.device.type == "cuda":
                torch.cuda.synchronize()
            first_ms = (time.perf_counter() - t0) * 1e3
            o = o[0].transpose(0, 1) if o.dim() == 4 else o
            if ref is None:
                ref = o.float()
            err = (o.float() - ref).abs().max().item()
            s = median_seconds(fn, dev.device, reps)
            timed[name] = {"ms": s * 1e3, "TFLOPs": flops / s / 1e12,
                           "of_peak": flops / s / peak, "max_abs_err": err,
                           "first_call_ms": first_ms}
        except Exception as e:  # a backend this torch or GPU lacks: recorded, skipped
            timed[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        if dev.device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"context {c}, chunk {t} ({flops / 1e12:.2f} TFLOP):", flush=True)
    for name, r in timed.items():
        if "error" in r:
            print(f"  {name:34s} {r['error']}")
        elif "TFLOPs" in r:
            print(f"  {name:34s} {r['ms']:9.3f} ms {r['TFLOPs']:7.1f} TFLOP/s "
                  f"({r['of_peak']:.2f} of peak) err {r['max_abs_err']:.3g}, "
                  f"first call {r['first_call_ms']:.0f} ms")
        else:
            print(f"  {name:34s} {r['ms']:9.3f} ms ({r['GB']:.2f} GB)")
    return {"context": c, "chunk": t, "TFLOP": flops / 1e12, "results": timed}


def _prompt(n: int, chunk: int, smoke: bool, dev: Any, dtype: torch.dtype, peak: float
            ) -> dict[str, Any]:
    """One layer of an n-token prompt's chunks in order (each at the end of a longer context,
    so every chunk meets new lengths), twice: the first pass pays Triton's compilations and
    cuDNN's plan building (TORCH_CUDNN_SDPA_AVOID_RECOMPILE decides how many plans), the
    second only the work."""
    scale = HEAD_DIM ** -0.5
    p = _paged(n, chunk, dev.device, dtype)
    backend = "math" if smoke else dense_backend(p["q"], KV_HEADS)
    starts = range(0, n, chunk)
    flops = sum(_flops(min(chunk, n - s), s + min(chunk, n - s)) for s in starts)

    def one_pass(path: str) -> float:
        t0 = time.perf_counter()
        for s in starts:
            t = min(chunk, n - s)
            q = p["q"][:t]
            if path == "triton":
                paged_prefill_attention(
                    q, p["cache"], p["qsl"].clamp(max=t), p["lens"].clamp(max=s + t),
                    p["table"], scale, t)
            else:
                dense_extend(q, p["cache"], p["table"][0], s + t, scale, backend=backend)
        if dev.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    out: dict[str, Any] = {"prompt": n, "chunk": chunk, "TFLOP": flops / 1e12,
                           "dense_backend": backend, "avoid_recompile":
                           os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE")}
    print(f"one layer of a {n}-token prompt in chunks of {chunk} ({flops / 1e12:.1f} TFLOP), "
          f"TORCH_CUDNN_SDPA_AVOID_RECOMPILE={out['avoid_recompile']}:", flush=True)
    for path in ("triton", "dense"):
        first, second = one_pass(path), one_pass(path)
        out[path] = {"first_pass_s": first, "second_pass_s": second,
                     "TFLOPs": flops / second / 1e12, "of_peak": flops / second / peak}
        print(f"  {path:8s} first pass {first:7.3f} s, then {second:7.3f} s "
              f"({flops / second / 1e12:.1f} TFLOP/s, {flops / second / peak:.2f} of peak)")
    return out


def run(contexts: list[int], chunk: int, configs: list[dict], reps: int, smoke: bool,
        prompt: int = 0) -> dict[str, Any]:
    dev = tune_device("prefill_attention_speed.py", smoke)
    dtype = torch.bfloat16 if dev.device.type == "cuda" else torch.float32
    peak = matmul_peak(dev.device)
    print(f"{dev.name}: bf16 matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    rows = [_context(c, min(chunk, c), configs, reps, smoke, dev, dtype, peak)
            for c in contexts]
    whole = _prompt(prompt, chunk, smoke, dev, dtype, peak) if prompt else None
    return {"benchmark": "prefill_attention_speed", "device": dev.name, "prompt": whole,
            "peak_TFLOPs": peak / 1e12, "heads": HEADS, "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "page": PAGE, "rows": rows,
            "machine": machine_info(str(dev.device))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--configs", nargs="*", default=[
        "BLOCK_M=128,BLOCK_N=128,num_stages=3,num_warps=8",
        "BLOCK_M=128,BLOCK_N=64,num_stages=3,num_warps=8"],
        help="Triton launch configurations, k=v,... each")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=0,
                    help="also one layer of a prompt of this many tokens, chunk by chunk, "
                         "twice (first pass: compilations and cuDNN plans)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.contexts, a.chunk, a.reps, a.prompt = [48], 32, 1, 80
        a.configs = ["BLOCK_M=16,BLOCK_N=16,num_stages=1,num_warps=4"]
    configs = [{k: int(v) for k, v in (kv.split("=") for kv in c.split(","))} for c in a.configs]
    result = run(a.contexts, a.chunk, configs, a.reps, a.smoke, a.prompt)
    result["command"] = "python " + " ".join(sys.argv)
    save_json(result, a.out)


if __name__ == "__main__":
    main()
