"""The CPU's decode products by kernel: the integer dot kernel (ops/cpu_intdot.py, 4-, 6- and
8-bit codes, activations rounded to int8 per 32 twice, or once: `_once`; `intdot_q6_as_q8`: 6-bit
codes stored in 8 bits, the layout before 6-bit packing) against torch's int4
kernel (one plane: 4-bit codes; two: 5- to 8-bit codes) and oneDNN's dense bfloat16 and float32
products (float32 activations for the latter), on the default model's
shapes (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536: every weight read
from memory once a step, as in a decode step) and its LM head (49,152 x 576; three copies taken
in turn, so that none is still in the last-level cache), at 1-16 rows.
The floor is the bytes each kernel reads over the read bandwidth measured in the same run.

    python bench/cpu_intdot_speed.py [--threads 2] [--rows 1,2,4,8,16] [--kinds a,b]
        [--out bench/results/cpu/cpu-intdot-speed-2threads.json]
    python bench/cpu_intdot_speed.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from skyline.bench.floor import host_read_bandwidth
from skyline.bench.offline import machine_info, save_json
from skyline.ops import cpu_int4, cpu_intdot, cpu_linear

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def kernel(kind: str, n: int, k: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """(product of x [M, k] bf16, bytes it reads) for a random weight [n, k]."""
    g = torch.Generator().manual_seed(n * k)
    if kind.startswith("intdot"):
        bits = int(kind[len("intdot_q")])
        codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
        codes[0, 0] = (1 << bits) - 1
        w = cpu_intdot.pack(codes, torch.rand(n, k // 32, generator=g),
                            torch.rand(n, k // 32, generator=g), 32,
                            1 if kind.endswith("_once") else 2)
        if "_as_q8" in kind:
            w = w._replace(codes=cpu_intdot.layout(codes, 8), bits=8)
        return (lambda x: cpu_intdot.intdot_mm(x, w)), w.nbytes()
    if kind.startswith("int4"):
        wide = kind == "int4_two_planes"
        codes = torch.randint(0, 256 if wide else 16, (n, k), generator=g, dtype=torch.uint8)
        planes = cpu_int4.pack_planes(codes, torch.rand(n, k // 32, generator=g),
                                      torch.zeros(n, k // 32), 32, wide)
        nbytes = sum(t.numel() * t.element_size() for p in planes for t in p)
        return (lambda x: cpu_int4.planes_mm(x, planes, 32)), nbytes
    w = torch.randn(n, k, generator=g).to(DTYPE.get(kind, torch.bfloat16))
    if not cpu_linear.can_pack(w):  # a CPU without bf16 instructions: torch's own product
        return (lambda x: F.linear(x, w)), n * k * w.itemsize
    packed = cpu_linear.pack(w)
    return (lambda x: cpu_linear.packed_linear(x, packed)), n * k * w.itemsize


DTYPE = {"fp32_dense": torch.float32}  # the activations' dtype by kernel (else bfloat16)


def time_step(products: list, rows: int, reps: int, dtype: torch.dtype) -> float:
    """Best seconds of one pass over every (product, K), each with its own input."""
    xs = [torch.randn(rows, k, dtype=dtype) for _, k in products]
    for (f, _), x in zip(products, xs, strict=True):
        f(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for (f, _), x in zip(products, xs, strict=True):
            f(x)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/cpu/cpu-intdot-speed-2threads.json")
    ap.add_argument("--kinds", default=None, help="comma-separated kernels (default: all here)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    layers, rows, reps, head = 30, [int(r) for r in args.rows.split(",")], args.reps, HEAD
    if args.smoke:
        layers, rows, reps, head, args.out = 1, [1, 2], 2, (256, 576), ""
    torch.set_num_threads(args.threads)
    kinds = ["bf16_dense", "fp32_dense"]
    if cpu_int4.has_kernel():
        kinds += ["int4_one_plane", "int4_two_planes"]
    if cpu_intdot.available():
        kinds += ["intdot_q4", "intdot_q8", "intdot_q4_once", "intdot_q8_once",
                  "intdot_q6_once", "intdot_q6_as_q8_once"]
    if args.kinds:
        kinds = [k for k in args.kinds.split(",") if k in kinds]
    bw = host_read_bandwidth(args.threads, 1 << 22 if args.smoke else 1 << 30)
    table = []
    for kind in kinds:
        body = [(*kernel(kind, n, k), k) for _ in range(layers) for n, k in LAYER.values()]
        heads = [kernel(kind, *head) for _ in range(1 if args.smoke else 3)]
        lm = heads[0]
        for m in rows:
            dtype = DTYPE.get(kind, torch.bfloat16)
            t_body = time_step([(f, k) for f, _, k in body], m, reps, dtype)
            t_head = time_step([(f, head[1]) for f, _ in heads], m, reps, dtype) / len(heads)
            body_bytes = sum(b for _, b, _ in body)
            table.append({"kernel": kind, "rows": m, "layers_ms": 1e3 * t_body,
                          "head_ms": 1e3 * t_head, "layers_bytes": body_bytes,
                          "head_bytes": lm[1],
                          "layers_floor_ratio": t_body / (body_bytes / bw),
                          "head_floor_ratio": t_head / (lm[1] / bw)})
            print(f"{kind:16s} rows {m:2d}: layers {1e3 * t_body:6.2f} ms "
                  f"({t_body / (body_bytes / bw):4.1f}x floor), head {1e3 * t_head:5.2f} ms "
                  f"({t_head / (lm[1] / bw):4.1f}x floor)", flush=True)
    save_json({"bench": "cpu_intdot_speed", "date": datetime.date.today().isoformat(),
               "machine": machine_info("cpu"), "threads": args.threads,
               "intdot_isa": cpu_intdot.isa(), "read_bandwidth_gbs": bw / 1e9,
               "layers": layers, "table": table}, args.out)


if __name__ == "__main__":
    main()
