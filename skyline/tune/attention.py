"""The paged attention tuner (skyline/ops/attention.py): decode over batch sizes x context
lengths and causal prefill, every candidate launch configuration checked against the PyTorch
reference (fp32) and timed as GPU time per call in a CUDA graph of back-to-back calls cycling
over disjoint sets of pages (at least ROTATE_BYTES of K/V, so L2 cannot serve them). Used by
`skyline tune` and bench/kernels/tune_attention.py (whose docstring says how each phase runs).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from skyline.bench.tuners import TuneDevice, device_bandwidth, shipped_config
from skyline.bench.tuners import time_calls as gpu_time
from skyline.ops import attention as attn
from skyline.ops.attention_config import batch_bucket
from skyline.ops.fp8_linear import has_fp8_units
from skyline.ops.tuning import dtype_name, token_bucket

ROTATE_BYTES = 256 << 20  # K/V touched per graph replay at least (5x an H200's L2)
REPLAY_S = 4e-3  # target GPU time of one graph replay
MAX_CALLS = 256
TOL = 1e-2  # relative (norm) error against the fp32 reference, as the bf16 kernel tests

# (BLOCK_N, num_warps, num_stages); num_stages 1 is the unpipelined while loop (the kernel
# before pipelining), kept as the baseline.
BASELINE = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
DECODE_TILES = [BASELINE] + [
    {"BLOCK_N": n, "num_warps": w, "num_stages": s}
    for n, w, s in [(32, 4, 3), (32, 4, 5), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
                    (128, 4, 3), (128, 8, 3), (16, 1, 3), (16, 1, 4), (32, 1, 2), (32, 1, 3),
                    (32, 1, 4), (64, 1, 2), (32, 2, 3), (64, 2, 2)]]
PREFILL_BASELINE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
# PACK > 1: the query heads of one kv head share a program (BLOCK_M then counts tokens)
PREFILL_TILES = [PREFILL_BASELINE] + [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "PACK": p}
    for m, n, w, s, p in [(64, 64, 4, 3, 1), (64, 64, 4, 4, 1), (64, 32, 4, 3, 1),
                          (128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (128, 32, 8, 4, 1),
                          (128, 128, 8, 2, 1), (128, 128, 8, 3, 1), (16, 64, 4, 3, 4),
                          (32, 64, 4, 3, 4), (32, 64, 8, 3, 4), (32, 128, 8, 2, 4),
                          (32, 32, 8, 4, 4), (64, 64, 8, 2, 4)]]
# (prompts, new tokens each, context each): fresh prompts, and a chunk of a long prompt over
# its cached prefix (what a 200K-token prompt's chunks run)
PREFILL_CASES = [(8, 1000, 1000), (1, 8192, 32768)]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
DTYPE = torch.bfloat16  # the model dtype: queries and outputs
SMOKE_SHAPES = {(4, 2, 16): {"llama-3.1-8b": 32}}  # (heads, kv heads, head_dim): layers


def attention_shapes(models: list[str]) -> dict[tuple[int, int, int], dict[str, int]]:
    """{(num_heads, num_kv_heads, head_dim): {model: num_layers}} of the shipped configs."""
    shapes: dict[tuple[int, int, int], dict[str, int]] = {}
    for model in models:
        c = shipped_config(model)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        shape = (heads, c.get("num_key_value_heads", heads), head_dim)
        shapes.setdefault(shape, {})[model] = c["num_hidden_layers"]
    return shapes


def random_cache(num_pages: int, page: int, kvh: int, d: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:  # [2, num_pages, page, kvh, d]
    cache = torch.empty(2, num_pages, page, kvh, d, device=device, dtype=dtype)
    for i in range(2):  # in slices: an fp32 randn of the whole cache may not fit beside it
        for p in range(0, num_pages, 8192):
            cache[i, p:p + 8192] = torch.randn(cache[i, p:p + 8192].shape, device=device)
    return cache


def page_tables(num_pages: int, copies: int, batch: int, nblk: int, device: torch.device
                ) -> list[torch.Tensor]:
    """`copies` block tables [batch, nblk] int32 over disjoint, shuffled pages."""
    perm = torch.randperm(num_pages, device=device)[:copies * batch * nblk].to(torch.int32)
    return list(perm.view(copies, batch, nblk))


def query_dtype(device: torch.device) -> torch.dtype:
    """The model dtype on a GPU; float32 in Triton's interpreter (smoke runs), which runs the
    attention kernels in float32 only."""
    return DTYPE if device.type == "cuda" else torch.float32


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.float() - ref).norm() / ref.norm()).item()


def try_config(cfg: dict, check: Callable[[dict], float], timed: Callable[[dict], float],
               failed: list[dict]) -> float | None:
    """Seconds per call of `cfg`, or None (recorded in `failed`) when it fails or mismatches."""
    try:
        err = check(cfg)
        if not err <= TOL:
            raise AssertionError(f"relative error {err:.3g} > {TOL}")
        return timed(cfg)
    except Exception as e:  # a config the GPU cannot run (shared memory, registers) or wrong
        failed.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None


def split_candidates(batch: int, kvh: int, max_ctx: int, block_n: int, num_sms: int
                     ) -> list[int]:
    """1 and 2 always (2 evens out the last wave at high batch), then powers of two while the
    launch stays within 8 programs per SM and each split keeps a tile."""
    out, s = [1, 2], 4
    while batch * kvh * s <= 8 * num_sms and s <= 64 and s * block_n <= max_ctx:
        out.append(s)
        s *= 2
    return out


def tune_decode(shape, kv_dtype, batches, contexts, page, copy_bw, num_sms, deadline, smoke,
                device) -> tuple[list[dict], dict[str, dict]]:
    """Decode rows for every (batch, context) and the chosen config per batch size."""
    heads, kvh, d = shape
    bytes_per_token = 2 * kvh * d * kv_dtype.itemsize
    max_blk = -(-max(contexts) // page)
    rotate_pages = 0 if smoke else -(-ROTATE_BYTES // (bytes_per_token * page))
    num_pages = max(max(batches) * max_blk, rotate_pages + max_blk) + 1
    cache = random_cache(num_pages, page, kvh, d, kv_dtype, device)
    results, chosen = [], {}
    for b in batches:
        rows, key, best = decode_batch(cache, shape, b, contexts, copy_bw, num_sms,
                                       time.time() < deadline and not smoke, smoke)
        results += rows
        if best is not None:
            chosen[key] = best
    del cache
    empty_cache(device)
    return results, chosen


def decode_batch(cache, shape, b, contexts, copy_bw, num_sms, sweep_splits, smoke
                 ) -> tuple[list[dict], str, dict | None]:
    heads, kvh, d = shape
    _, num_pages, page, _, _ = cache.shape
    device = cache.device
    dtype, item = query_dtype(device), cache.dtype.itemsize
    key = attn.shape_key(heads, kvh, d, page, dtype, cache.dtype) + f":b{b}"
    scale = d**-0.5
    cases = []
    for ctx in contexts:
        nblk = -(-ctx // page)
        kv_bytes = b * ctx * 2 * kvh * d * item
        copies = max(1, min(-(-ROTATE_BYTES // kv_bytes), (num_pages - 1) // (b * nblk)))
        tables = page_tables(num_pages, copies, b, nblk, device)
        q = torch.randn(b, heads, d, device=device, dtype=dtype)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        ref = torch.cat([attn.paged_attention_ref(  # fp32, 32 sequences at a time
            q[s:s + 32].float(), cache, list(range(min(32, b - s) + 1)), [ctx] * min(32, b - s),
            tables[0][s:s + 32], scale, min(32, b - s), lens[s:s + 32]) for s in range(0, b, 32)])
        calls = 1 if smoke else max(copies, min(MAX_CALLS, round(REPLAY_S * 3e12 / kv_bytes)))
        cases.append({"ctx": ctx, "q": q, "lens": lens, "tables": tables, "ref": ref,
                      "kv_bytes": kv_bytes, "calls": calls, "times": {}, "failed": []})

    def run(c, cfg, table):
        return attn.paged_decode_attention(c["q"], cache, table, c["lens"], scale, config=cfg)

    def measure(cfg):
        name = json.dumps(cfg, sort_keys=True)
        for c in cases:
            if name not in c["times"]:
                c["times"][name] = try_config(
                    cfg, lambda f, c=c: relative_error(run(c, f, c["tables"][0]), c["ref"]),
                    lambda f, c=c: gpu_time([lambda t=t: run(c, f, t) for t in c["tables"]],
                                            c["calls"]), c["failed"])

    fp8_units = device.type == "cuda" and has_fp8_units(device)
    default = attn.default_decode_config(b, kvh, d, item, num_sms, fp8_units)
    heuristic = attn.decode_splits(b, kvh, num_sms)
    for tile in DECODE_TILES[:2] if smoke else DECODE_TILES:
        measure({**tile, "NUM_SPLITS": heuristic})  # phase 1: tiles and pipeline depths
    measure(default)
    ranked = rank(cases)
    if sweep_splits:  # phase 2: split counts for the two best tiles
        for name, _ in ranked[:2]:
            tile = json.loads(name)
            for s in split_candidates(b, kvh, max(contexts), tile["BLOCK_N"], num_sms):
                measure({**tile, "NUM_SPLITS": s})
        ranked = rank(cases)
    if not ranked:
        print(f"decode b{b}: no config ran: {cases[0]['failed'][:2]}", flush=True)
        return [], key, None
    best = json.loads(ranked[0][0])
    names = {"baseline": json.dumps({**BASELINE, "NUM_SPLITS": heuristic}, sort_keys=True),
             "default": json.dumps(default, sort_keys=True), "chosen": ranked[0][0]}
    rows = []
    for c in cases:
        t = c["times"]
        row = {"kv_dtype": kv_name(cache.dtype), "batch": b, "context": c["ctx"],
               "key": key, "kv_GB": c["kv_bytes"] / 1e9, "calls": c["calls"], "config": best}
        for label, name in names.items():
            s = t.get(name)
            row[f"{label}_us"] = _us(s)
            row[f"{label}_frac"] = None if s is None else c["kv_bytes"] / s / copy_bw
        row["fastest"] = [{"us": s * 1e6, "frac": c["kv_bytes"] / s / copy_bw,
                           "config": json.loads(n)}
                          for n, s in sorted(((n, s) for n, s in t.items() if s is not None),
                                             key=lambda ns: ns[1])[:5]]
        row["num_timed"] = sum(s is not None for s in t.values())
        row["failed"] = c["failed"]
        rows.append(row)
        print(f"decode {row['kv_dtype']} b{b:<3} ctx{c['ctx']:<5} K/V {row['kv_GB']:6.3f} GB"
              f"  while-loop {_fmt(row['baseline_us'], row['baseline_frac'])}"
              f"  default {_fmt(row['default_us'], row['default_frac'])}"
              f"  tuned {_fmt(row['chosen_us'], row['chosen_frac'])}  {best}", flush=True)
    return rows, key, best


def rank(cases: list[dict]) -> list[tuple[str, float]]:
    """Configs timed at every context, by mean time relative to each context's fastest."""
    names = [n for n in cases[0]["times"] if all(c["times"].get(n) for c in cases)]
    if not names:
        return []
    best = [min(c["times"][n] for n in names) for c in cases]
    scored = [(n, sum(c["times"][n] / t for c, t in zip(cases, best, strict=True)) / len(cases))
              for n in names]
    return sorted(scored, key=lambda x: x[1])


def tune_prefill(shape, kv_dtype, page, smoke, device) -> tuple[list[dict], dict[str, dict]]:
    """Prefill rows for PREFILL_CASES and the chosen config per token bucket."""
    results, chosen = [], {}
    for num_seqs, n, ctx in [(1, 32, 48)] if smoke else PREFILL_CASES:
        row = prefill_case(shape, kv_dtype, page, num_seqs, n, ctx, smoke, device)
        empty_cache(device)
        if row is not None:
            results.append(row)
            chosen[row["key"]] = row["config"]
    return results, chosen


def prefill_case(shape, kv_dtype, page, num_seqs, n, ctx, smoke, device) -> dict | None:
    heads, kvh, d = shape
    dtype = query_dtype(device)
    key = attn.shape_key(heads, kvh, d, page, dtype, kv_dtype) + f":q{token_bucket(n)}"
    scale = d**-0.5
    nblk = -(-ctx // page)
    cache = random_cache(num_seqs * nblk + 1, page, kvh, d, kv_dtype, device)
    table = page_tables(num_seqs * nblk + 1, 1, num_seqs, nblk, device)[0]
    q = torch.randn(num_seqs * n, heads, d, device=device, dtype=dtype)
    qsl = list(range(0, num_seqs * n + 1, n))
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    lens = [ctx] * num_seqs
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)

    def ref_fn():
        return attn.paged_attention_ref(q, cache, qsl, lens, table, scale)

    def run(cfg):
        return attn.paged_prefill_attention(q, cache, qsl_t, lens_t, table, scale, n,
                                            config=cfg)

    ref = ref_fn().float()
    # causal QK^T and PV: each new token sees the cached prefix and the new ones before it
    flops = 4 * heads * d * num_seqs * (n * (ctx - n) + n * (n + 1) / 2)
    calls = 1 if smoke else max(2, min(64, round(REPLAY_S * 300e12 / flops)))
    try:
        t_ref = gpu_time([ref_fn], calls)
    except Exception as e:  # the reference is only a yardstick here
        print(f"reference not timed: {type(e).__name__}: {e}"[:200], flush=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_ref = None
    times, failed = {}, []
    default = attn.default_prefill_config(n, d, kv_dtype.itemsize)
    tiles = PREFILL_TILES[:2] if smoke else PREFILL_TILES
    for cfg in tiles + ([default] if default not in tiles else []):
        times[json.dumps(cfg, sort_keys=True)] = try_config(
            cfg, lambda f: relative_error(run(f), ref),
            lambda f: gpu_time([lambda: run(f)], calls), failed)
    ok = sorted((t, name) for name, t in times.items() if t is not None)
    if not ok:
        print(f"prefill {num_seqs}x{n}: no config ran: {failed[:2]}", flush=True)
        return None

    def tflops(t):
        return None if t is None else flops / t / 1e12

    row = {"kv_dtype": kv_name(kv_dtype), "prompts": num_seqs,
           "tokens": n, "context": ctx, "key": key, "TFLOP": flops / 1e12,
           "config": json.loads(ok[0][1])}
    for label, t in [("reference", t_ref), ("chosen", ok[0][0]),
                     ("baseline", times.get(json.dumps(PREFILL_BASELINE, sort_keys=True))),
                     ("default", times.get(json.dumps(default, sort_keys=True)))]:
        row[f"{label}_us"], row[f"{label}_TFLOPs"] = _us(t), tflops(t)
    row["fastest"] = [{"us": t * 1e6, "TFLOPs": tflops(t), "config": json.loads(c)}
                      for t, c in ok[:5]]
    row["failed"] = failed
    print(f"prefill {row['kv_dtype']} {num_seqs}x{n}/{ctx}  reference (gather + SDPA) "
          f"{_fmt(row['reference_us'], row['reference_TFLOPs'], 'TFLOP/s')}  while-loop "
          f"{_fmt(row['baseline_us'], row['baseline_TFLOPs'], 'TFLOP/s')}  default "
          f"{_fmt(row['default_us'], row['default_TFLOPs'], 'TFLOP/s')}  tuned "
          f"{_fmt(row['chosen_us'], row['chosen_TFLOPs'], 'TFLOP/s')}  {row['config']}",
          flush=True)
    return row


def kv_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype.itemsize == 1 else dtype_name(dtype)


def _us(t: float | None) -> float | None:
    return None if t is None else t * 1e6


def _fmt(us: float | None, x: float | None, unit: str = "") -> str:
    # "  812.3 us (0.71)" or "  812.3 us (402 TFLOP/s)"; "failed" when the config did not run
    if us is None:
        return "failed"
    return f"{us:8.1f} us ({x:.0f} {unit})" if unit else f"{us:8.1f} us ({x:.2f})"


def tune_model(arch: Any, kv_cache_dtype: str, page: int, batches: list[int],
               contexts: list[int], budget_s: float, dev: TuneDevice, prefill_len: int = 0,
               log: Any = print) -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {key: config}} for one model's attention shape: decode at the batch buckets of
    `batches` over `contexts`, then (time left) the prefill of one `prefill_len`-token prompt,
    with the engine's KV dtype ("auto" or "fp8_e4m3") and page size."""
    t0 = time.time()
    smoke = dev.out_dir is not None
    shape = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
    if dev.device.type != "cuda":
        kv_dtype = query_dtype(dev.device)
    else:
        kv_dtype = torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else DTYPE
    buckets = sorted({batch_bucket(b) for b in batches})
    copy_bw = device_bandwidth(dev, 2**29)
    _, chosen = tune_decode(shape, kv_dtype, buckets, contexts, page, copy_bw, dev.num_sms,
                            t0 + budget_s / 2, smoke, dev.device)
    configs: dict[str, dict[str, dict[str, Any]]] = {attn.DECODE_KERNEL: chosen}
    if prefill_len and time.time() - t0 < budget_s / 2:
        n = 32 if smoke else prefill_len
        row = prefill_case(shape, kv_dtype, page, 1, n, n, smoke, dev.device)
        empty_cache(dev.device)
        if row is not None:
            configs[attn.PREFILL_KERNEL] = {row["key"]: row["config"]}
    else:
        log("  attention: no time left for the prefill")
    return {k: v for k, v in configs.items() if v}
