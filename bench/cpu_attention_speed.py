"""CPU attention paths of `skyline/ops/attention.py` and attention_ref.py against torch's SDPA,
for the default model's heads (9 query / 3 kv heads, head_dim 64): one query over a context (a
decode) in bfloat16 and float32, and a few queries with a causal mask over a longer context (a
verification's drafts, `_attend_small`) against masked SDPA.

  python bench/cpu_attention_speed.py --threads 2 \
      --out bench/results/cpu/cpu-attention-2threads.json
  python bench/cpu_attention_speed.py --smoke   # one case of each, a few calls
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from skyline.bench.offline import median_call_s
from skyline.ops.attention_ref import _attend_small

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


def extend_rows(g: torch.Generator, smoke: bool) -> list[dict]:
    rows = []
    min_s = 0.01 if smoke else 0.3
    for q_len, ctx in ((3, 300),) if smoke else ((3, 300), (9, 1000), (9, 4000), (64, 1000)):
        q = torch.randn(HEADS, q_len, DIM, generator=g)
        k = torch.randn(KV_HEADS, ctx, DIM, generator=g)
        v = torch.randn(KV_HEADS, ctx, DIM, generator=g)
        mask = torch.arange(ctx - q_len, ctx)[:, None] >= torch.arange(ctx)[None, :]
        t_sdpa = median_call_s(lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=m, scale=SCALE, enable_gqa=True), min_s)
        t_small = median_call_s(lambda q=q, k=k, v=v, m=mask: _attend_small(q, k, v, m, SCALE),
                                min_s)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE,
                                             enable_gqa=True)
        err = (_attend_small(q, k, v, mask, SCALE) - ref).abs().max().item()
        rows.append({"queries": q_len, "context": ctx, "sdpa_masked_us": t_sdpa * 1e6,
                     "attend_small_us": t_small * 1e6, "speedup": t_sdpa / t_small,
                     "max_abs_diff": err})
        print(f"extend, {q_len:2d} queries over {ctx:5d}: masked SDPA {t_sdpa * 1e6:7.1f} us, "
              f"_attend_small {t_small * 1e6:7.1f} us ({t_sdpa / t_small:.2f}x)", flush=True)
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
           "decode": decode_rows(g, a.smoke), "extend": extend_rows(g, a.smoke)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
