"""CPU attention paths of `skyline/ops/attention.py` and attention_ref.py against torch's SDPA,
for the default model's heads (9 query / 3 kv heads, head_dim 64): one query over a context (a
decode) in bfloat16 and float32; a causal prefill and a few queries with a causal mask over a
longer context (an extend: a chunk, a prefix hit, a verification's drafts), each as skyline
calls SDPA (4-D inputs: torch's flash kernel) against 3-D inputs (torch's math kernel, which
holds every score) and `_attend_small`'s matmuls (the path of extends with sinks); and a
decode over the paged bf16 KV cache as the CPU decode step runs it, in C++
(csrc/cpu_decode.cpp's decode_attention, where skyline's CPU operations build) against its
Python path (ops/cpu_attention.decode_attention_cpu), for one sequence and for a batch of 16.

  python bench/cpu_attention_speed.py --threads 2 \
      --out bench/results/cpu/cpu-attention-2threads.json
  python bench/cpu_attention_speed.py --smoke   # one case of each, a few calls
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import torch
import torch.nn.functional as F

from skyline.bench.offline import median_call_s
from skyline.ops import cpu_ext
from skyline.ops.attention_ref import _attend_small
from skyline.ops.cpu_attention import decode_attention_cpu, decode_gather

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = DIM**-0.5


def decode_rows(g: torch.Generator, smoke: bool) -> list[dict]:
    rows = []
    min_s = 0.01 if smoke else 0.3
    for ctx in (100,) if smoke else (100, 300, 1000, 4000):
        q = torch.randn(1, HEADS, 1, DIM, generator=g)
        k = torch.randn(1, KV_HEADS, ctx, DIM, generator=g)
        v = torch.randn(1, KV_HEADS, ctx, DIM, generator=g)
        t = {}
        for dtype in (torch.float32, torch.bfloat16):
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            t[str(dtype).removeprefix("torch.")] = median_call_s(
                lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(
                    qd, kd, vd, scale=SCALE, enable_gqa=True), min_s)
        rows.append({"context": ctx, "sdpa_float32_us": t["float32"] * 1e6,
                     "sdpa_bfloat16_us": t["bfloat16"] * 1e6,
                     "bfloat16_over_float32": t["bfloat16"] / t["float32"]})
        print(f"decode, context {ctx:5d}: SDPA float32 {t['float32'] * 1e6:7.1f} us, "
              f"bfloat16 {t['bfloat16'] * 1e6:7.1f} us", flush=True)
    return rows


def _sdpa(q, k, v, mask, batched: bool):
    """torch's attention as attend_ref calls it (`batched`: with a batch dimension) or on the
    3-D tensors themselves."""
    args = (t[None] if batched else t for t in (q, k, v))
    return F.scaled_dot_product_attention(*args, attn_mask=mask, scale=SCALE,
                                          is_causal=mask is None, enable_gqa=True)


def extend_rows(g: torch.Generator, smoke: bool) -> list[dict]:
    """Prefills (causal, no mask: `queries` == `context`) and extends (a mask) in bfloat16."""
    rows = []
    min_s = 0.01 if smoke else 0.3
    cases = ((3, 300), (64, 64)) if smoke else (
        (64, 64), (512, 512), (1024, 1024), (3, 300), (9, 1000), (64, 1000), (512, 1024))
    for q_len, ctx in cases:
        q = torch.randn(HEADS, q_len, DIM, generator=g).bfloat16()
        k = torch.randn(KV_HEADS, ctx, DIM, generator=g).bfloat16()
        v = torch.randn(KV_HEADS, ctx, DIM, generator=g).bfloat16()
        causal = torch.arange(ctx - q_len, ctx)[:, None] >= torch.arange(ctx)[None, :]
        mask = None if q_len == ctx else causal
        t = {name: median_call_s(functools.partial(_sdpa, q, k, v, mask, b), min_s)
             for name, b in (("4d", True), ("3d", False))}
        t_small = median_call_s(functools.partial(_attend_small, q, k, v, causal, SCALE), min_s)
        ref = _sdpa(q.float(), k.float(), v.float(), mask, False)
        err = (_sdpa(q, k, v, mask, True)[0].float() - ref).abs().max().item()
        rows.append({"queries": q_len, "context": ctx, "sdpa_4d_us": t["4d"] * 1e6,
                     "sdpa_3d_us": t["3d"] * 1e6, "attend_small_us": t_small * 1e6,
                     "speedup_4d_over_3d": t["3d"] / t["4d"], "max_abs_diff_4d": err})
        kind = "prefill" if mask is None else "extend"
        print(f"{kind:7}, {q_len:4d} queries over {ctx:5d}: SDPA 4-D {t['4d'] * 1e6:8.1f} us, "
              f"3-D {t['3d'] * 1e6:8.1f} us ({t['3d'] / t['4d']:.2f}x), _attend_small "
              f"{t_small * 1e6:8.1f} us", flush=True)
    return rows


def paged_rows(g: torch.Generator, smoke: bool) -> list[dict]:
    if not cpu_ext.available():
        print("paged decode: skyline's CPU operations do not build here; skipped")
        return []
    rows, bs = [], 16
    min_s = 0.01 if smoke else 0.3
    # (sequences, cached tokens each): one sequence, and a decode batch of 16 (16 streams)
    cases = [(1, 100), (2, 100)] if smoke else [
        (1, 64), (1, 256), (1, 1024), (1, 4000), (16, 128), (16, 400)]
    for n, ctx in cases:
        nblk = -(-ctx // bs)
        cache = torch.randn(2, n * nblk + 3, bs, KV_HEADS, DIM, generator=g).bfloat16()
        table = torch.randperm(n * nblk + 3, generator=g)[: n * nblk].view(n, nblk).int()
        q = torch.randn(n, HEADS + 2 * KV_HEADS, DIM, generator=g).bfloat16()[:, :HEADS]
        gather, lens = decode_gather([ctx] * n, table, bs), torch.tensor([ctx] * n)
        blocks = gather.blocks.long()
        t_py = median_call_s(lambda q=q, c=cache, gt=gather: decode_attention_cpu(
            q, c, gt, SCALE), min_s)
        t_cpp = median_call_s(lambda q=q, c=cache, b=blocks, n=lens: (
            torch.ops.skyline_cpu.decode_attention(q, c, b, n, SCALE)), min_s)
        kv_bytes = n * ctx * 2 * KV_HEADS * DIM * 2  # K and V rows read, bf16
        rows.append({"sequences": n, "context": ctx, "python_path_us": t_py * 1e6,
                     "cpp_us": t_cpp * 1e6, "speedup": t_py / t_cpp,
                     "cpp_kv_gbs": kv_bytes / t_cpp / 1e9})
        print(f"paged decode, {n:2d} x context {ctx:5d}: Python path {t_py * 1e6:7.1f} us, "
              f"C++ {t_cpp * 1e6:7.1f} us ({t_py / t_cpp:.2f}x; KV read at "
              f"{kv_bytes / t_cpp / 1e9:.1f} GB/s)", flush=True)
    return rows + cold_rows(g, smoke)


def cold_rows(g: torch.Generator, smoke: bool) -> list[dict]:
    """A decode step's attention as the engine meets it: one call a layer for 30 layers, each
    layer's cache read once a step (the other layers' weights evict it in between), a
    sequence's blocks consecutive (freshly allocated) or scattered (a cache in use)."""
    rows, bs, layers = [], 16, 2 if smoke else 30
    nb = 64 if smoke else 4000  # blocks a layer: 49 MB of bf16 cache, 1.5 GB in all
    for n, ctx in [(2, 100)] if smoke else [(16, 128), (16, 400), (1, 2000)]:
        nblk = -(-ctx // bs)
        caches = [torch.randn(2, nb, bs, KV_HEADS, DIM, generator=g).bfloat16()
                  for _ in range(layers)]
        q = torch.randn(n, HEADS, DIM, generator=g).bfloat16()
        lens = torch.tensor([ctx] * n)
        for layout in ("consecutive", "scattered"):
            ids = (torch.arange(n * nblk) if layout == "consecutive"
                   else torch.randperm(nb, generator=g)[: n * nblk])
            blocks = decode_gather([ctx] * n, ids.view(n, nblk).int(), bs).blocks.long()
            t = median_call_s(lambda q=q, b=blocks, n_=lens, cs=caches: [
                torch.ops.skyline_cpu.decode_attention(q, c, b, n_, SCALE) for c in cs],
                0.01 if smoke else 0.5)
            kv_bytes = layers * n * ctx * 2 * KV_HEADS * DIM * 2
            rows.append({"sequences": n, "context": ctx, "layers": layers, "blocks": layout,
                         "step_ms": t * 1e3, "kv_gbs": kv_bytes / t / 1e9})
            print(f"decode step's attention, {layers} layers, {n:2d} x context {ctx:5d}, "
                  f"{layout:11s} blocks: {t * 1e3:6.2f} ms (KV read at {kv_bytes / t / 1e9:.1f} "
                  "GB/s)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="one case of each kind, a few calls")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    res = {"benchmark": "CPU attention: torch SDPA vs skyline's CPU paths",
           "machine": f"{platform.machine()}, {platform.platform()}", "torch": torch.__version__,
           "threads": a.threads, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "decode": decode_rows(g, a.smoke), "extend": extend_rows(g, a.smoke),
           "paged_decode": paged_rows(g, a.smoke)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
