"""The block-scaled GEMV's tuner (skyline/ops/gemv_block.py: NVFP4, MXFP4, GGUF Q6_K and Q5_K
read as stored): candidate launch configurations of its integer and tensor-core modes for each
Linear shape a model's decode runs, each checked against the reference and timed as GPU time per
call in a CUDA graph of back-to-back calls over enough weight copies that L2 cannot serve them;
the fastest is kept where it beats the default. Used by `skyline tune` for NVFP4, MXFP4 and GGUF
models.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from skyline.bench import tuners
from skyline.bench.gguf_blocks import random_blocks
from skyline.config import ModelArch
from skyline.ops.gemv import MAX_ROWS
from skyline.ops.gemv_block import (
    FORMAT_NAMES,
    GGUF_FORMATS,
    KERNELS,
    MXFP4,
    NVFP4,
    Q5_K,
    Q6_K,
    SUPER,
    config_key,
    default_config,
    gguf_gemv,
    gguf_gemv_ref,
    mxfp4_gemv,
    mxfp4_gemv_ref,
    nvfp4_gemv,
    nvfp4_gemv_ref,
)
from skyline.tune.workload import model_linears

GGUF_TYPES = {fmt: qtype for qtype, fmt in GGUF_FORMATS.items()}  # FORMAT -> ggml type id


def formats_of(quantization: str | None, model: str) -> list[int]:
    """The block formats a model's Linears may be stored in: NVFP4 / MXFP4 for --quantization
    nvfp4 / mxfp4; Q6_K and Q5_K for a GGUF file (its tensor types are known only once loaded:
    both)."""
    if quantization in ("nvfp4", "mxfp4"):
        return [NVFP4 if quantization == "nvfp4" else MXFP4]
    if quantization == "gguf" or str(model).endswith(".gguf"):
        return [Q6_K, Q5_K]
    return []


def shapes(arch: ModelArch, fmt: int) -> list[tuple[int, int]]:
    """[(N, K)] the format's GEMV runs for one decoder layer: FP4 layers are merged (qkv,
    gate_up), a GGUF file's tensors are one per projection; GGUF widths are whole
    super-blocks."""
    if fmt in (NVFP4, MXFP4):
        return model_linears(arch)
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    out = list(dict.fromkeys([(q, h), (kv, h), (h, q), (i, h), (h, i)]))
    return [(n, k) for n, k in out if k % SUPER == 0]


def candidates(fmt: int, m: int, n: int, k: int, num_sms: int) -> list[dict[str, Any]]:
    """Launch configurations worth timing at m rows: integer-mode tiles of 4 or 8 rows, 1-4
    super-blocks (256-1,024 columns), 1 or 2 warps; tensor-core tiles of 16 or 32 rows; split K
    while each split keeps two tiles and there are at most ~32 programs an SM. The default comes
    first."""
    out = [default_config(fmt, m, n, k, num_sms)]
    tiles = [(True, bn, bk, w) for bk in (256, 512, 1024) for bn in (4, 8) for w in (1, 2)
             if bn * m <= 64]
    tiles += [(False, bn, SUPER, 4) for bn in (16, 32)]
    for a8, bn, bk, warps in tiles:
        for split in (1, 2, 4, 8):
            if split > 1 and (k // (split * bk) < 2 or -(-n // bn) * split > 32 * num_sms):
                break
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "A8": a8,
                   "num_warps": warps, "num_stages": 1 if a8 else 2}
            if cfg not in out:
                out.append(cfg)
    return out


def random_weight(fmt: int, n: int, k: int, device: torch.device, seed: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    """One random [n, k] weight's stored tensors (NVFP4: random codes, E4M3 block scales and a
    tensor scale, the width padded to 16 as a layer stores it; MXFP4: random codes and E8M0
    scales 2^-8..2^-5, padded to 32; GGUF: random blocks)."""
    if fmt == MXFP4:
        g = torch.Generator().manual_seed(seed)
        kp = -(-k // 32) * 32
        q = torch.randint(0, 256, (n, kp // 2), generator=g, dtype=torch.uint8)
        s = torch.randint(119, 123, (n, kp // 32), generator=g, dtype=torch.uint8)
        return q.to(device), s.to(device)
    if fmt == NVFP4:
        g = torch.Generator().manual_seed(seed)
        kp = -(-k // 16) * 16
        q = torch.randint(0, 256, (n, kp // 2), generator=g, dtype=torch.uint8)
        s = (torch.rand(n, kp // 16, generator=g) + 0.5).to(torch.float8_e4m3fn)
        return q.to(device), s.to(device), torch.full((n,), 0.01, device=device)
    return (random_blocks(GGUF_TYPES[fmt], n, k, seed, scale=1e-3).to(device),)


def call(fmt: int, x: torch.Tensor, w: tuple[torch.Tensor, ...], cfg: dict | None = None
         ) -> torch.Tensor:
    """The block GEMV of x and a weight's stored tensors `w` (random_weight's), with `cfg`."""
    if fmt == NVFP4:
        return nvfp4_gemv(x, *w, config=cfg)
    if fmt == MXFP4:
        return mxfp4_gemv(x, *w, config=cfg)
    return gguf_gemv(x, w[0], GGUF_TYPES[fmt], config=cfg)


def reference(fmt: int, x: torch.Tensor, w: tuple[torch.Tensor, ...], a8: bool
              ) -> torch.Tensor:
    """call's reference (with a8, x rounded as the integer mode rounds it)."""
    if fmt == NVFP4:
        return nvfp4_gemv_ref(x, *w, a8=a8)
    if fmt == MXFP4:
        return mxfp4_gemv_ref(x, *w, a8=a8)
    return gguf_gemv_ref(x, w[0], GGUF_TYPES[fmt], a8=a8)


def tune_shape(fmt: int, n: int, k: int, rows: list[int], copy_bw: float,
               dev: tuners.TuneDevice, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per row count: the fastest candidate that matches the reference, and the default's time
    (microseconds, fraction of the copy bandwidth for the stored bytes)."""
    first = random_weight(fmt, n, k, dev.device)
    nbytes = sum(t.numel() * t.element_size() for t in first)
    copies = 1 if dev.out_dir else max(1, math.ceil(tuners.ROTATE_BYTES / nbytes))
    weights = [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)]
    calls = 1 if dev.out_dir else min(512, copies * max(
        1, round(tuners.REPLAY_S * 4e12 / nbytes / copies)))
    results = []
    for m in rows:
        x = torch.randn(m, k, device=dev.device, dtype=dtype)
        refs = {a8: reference(fmt, x, weights[0], a8).float() for a8 in (False, True)}
        cands = candidates(fmt, m, n, k, dev.num_sms)
        timed, failed = [], []
        for cfg in cands[:2] + cands[-1:] if dev.out_dir else cands:
            ref = refs[cfg["A8"]]
            try:
                err = (call(fmt, x, weights[0], cfg).float() - ref).abs().max().item()
                if not err <= 1e-2 * ref.abs().max().item() + 1e-3:
                    raise AssertionError(f"max error {err:.3g}")
                t = tuners.time_calls([lambda w=w, x=x, c=cfg: call(fmt, x, w, c)
                                       for w in weights], calls)
            except Exception as e:  # a configuration the GPU cannot run
                failed.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            timed.append((t, cfg))
        if not timed:
            raise SystemExit(f"no block GEMV config ran for {FORMAT_NAMES[fmt]} {n}x{k}, "
                             f"m={m}: {failed[:2]}")
        t_default = next((t for t, c in timed if c == cands[0]), None)
        t_best, best = min(timed, key=lambda tc: tc[0])
        results.append({
            "format": FORMAT_NAMES[fmt], "N": n, "K": k, "rows": m,
            "key": config_key(m, n, k), "config": best, "us": t_best * 1e6,
            "frac": nbytes / t_best / copy_bw,
            "default_us": None if t_default is None else t_default * 1e6,
            "num_timed": len(timed), "failed": failed})
    del weights
    if dev.device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def tune_model(arch: ModelArch, formats: list[int], rows: list[int], budget_s: float,
               dev: tuners.TuneDevice, dtype: torch.dtype, log: Any = print
               ) -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {key: config}} for each format's Linear shapes of `arch` at each of `rows`
    (those the GEMV takes), shapes in turn until `budget_s` is spent; a shape is kept only
    where a candidate beat the default."""
    t0 = time.monotonic()
    copy_bw = tuners.device_bandwidth(dev)
    rows = sorted({r for r in rows if 1 <= r <= MAX_ROWS})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for fmt in formats:
        for n, k in shapes(arch, fmt):
            if time.monotonic() - t0 > budget_s:
                log(f"  block GEMV: the budget is spent before {FORMAT_NAMES[fmt]} {n}x{k}")
                return out
            for r in tune_shape(fmt, n, k, rows, copy_bw, dev, dtype):
                default = "failed" if r["default_us"] is None else f"{r['default_us']:.1f} us"
                log(f"  {r['format']} {n}x{k} m={r['rows']}: {r['us']:.1f} us "
                    f"({r['frac']:.2f} of the copy bandwidth; default {default}) {r['config']}")
                if r["default_us"] is None or r["us"] < r["default_us"]:
                    out.setdefault(KERNELS[fmt], {})[r["key"]] = r["config"]
    return out
