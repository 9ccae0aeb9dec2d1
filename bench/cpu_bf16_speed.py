"""bfloat16 decode products on the CPU by kernel: skyline's bf16 kernel (ops/cpu_bf16.py) on
the weights where torch put them and in huge pages, as a CPU engine holds them
(ops/host_memory.py), against oneDNN's product on its packed weight (ops/cpu_linear.py) and
torch's F.linear on the plain weight, at 1-16 rows; for prefill-sized batches where oneDNN packs
no bfloat16 (AVX2), skyline's float32 GEMMs over slabs of the converted weight
(`skyline_wide`: cpu_bf16.bf16_wide_mm) against F.linear on the plain weight and on a float32
copy (`float32_linear`: twice the bytes, what a float32 plan holds); on a Llama-3.1-8B layer's
shapes (qkv
6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336: 436 MB a layer, two layers taken in
turn so that nothing is still in the last-level cache) and the default model's (30 layers of
960x576, 576x576, 3072x576, 576x1536).
The floor is the weight's bytes over the read bandwidth measured in the same run. A CPU
without AVX-512 BF16 is emulated on one with it through the environment (recorded in the
JSON): SKYLINE_CPU_INTDOT_MARCH=skylake-avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE for AVX-512F.

    python bench/cpu_bf16_speed.py [--threads 2] [--rows 1,2,4,8,16] [--shapes llama8b,smollm2]
        [--kernels skyline_bf16,skyline_wide,...]
        [--out bench/results/cpu/cpu-bf16-speed-2threads.json]
    python bench/cpu_bf16_speed.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from skyline.bench.floor import host_read_bandwidth, median_seconds
from skyline.bench.offline import machine_info, save_json
from skyline.ops import cpu_bf16, cpu_linear, host_memory

EMULATION = ("SKYLINE_CPU_INTDOT_MARCH", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
KINDS = ("skyline_bf16", "skyline_bf16_huge_pages", "onednn_packed", "torch_linear",
         "skyline_wide", "float32_linear")
SHAPES = {  # name: (layers, [(N, K), ...])
    "llama8b": (2, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]),
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
}


def kernel(kind: str, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if kind == "skyline_bf16":
        return (lambda x: cpu_bf16.bf16_mm(x, w)) if cpu_bf16.available() else None
    if kind == "skyline_wide":
        return (lambda x: cpu_bf16.bf16_wide_mm(x, w)) if cpu_bf16.available() else None
    if kind == "float32_linear":
        wf = w.float()
        return lambda x: F.linear(x.float(), wf)
    if kind == "onednn_packed":
        if not cpu_linear.can_pack(w):
            return None
        packed = cpu_linear.pack(w)
        return lambda x: cpu_linear.packed_linear(x, packed)
    return lambda x: F.linear(x, w)


def huge_pages(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the weights in mappings advised to huge pages, 64 MiB at a time (as the
    loader places a CPU engine's streamed weights: model/loader.py)."""
    holder, out, chunk = SimpleNamespace(), [], []
    for w in [*weights, None]:
        if w is not None:
            chunk.append(w)
        if chunk and (w is None or sum(t.numel() * 2 for t in chunk) >= 64 << 20):
            holder.ws = tuple(chunk)
            host_memory.into_huge_pages([(holder, "ws")])
            out += holder.ws
            chunk = []
    return out


def time_step(fns: list[Callable], ks: list[int], rows: int, reps: int) -> float:
    """Median seconds of one pass over every product, each with its own input."""
    xs = [torch.randn(rows, k, dtype=torch.bfloat16) for k in ks]
    return median_seconds(lambda: [f(x) for f, x in zip(fns, xs, strict=True)],
                          torch.device("cpu"), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--shapes", default="llama8b,smollm2")
    ap.add_argument("--kernels", default=",".join(KINDS), help="of " + ", ".join(KINDS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="bench/results/cpu/cpu-bf16-speed-2threads.json")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    rows, reps = [int(r) for r in args.rows.split(",")], args.reps
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    kinds = [k for k in args.kernels.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"--kernels: unknown {', '.join(sorted(unknown))}; of {', '.join(KINDS)}")
    if args.smoke:
        rows, reps, args.out = [1, 3], 2, ""
        shapes = {"smoke": (2, [(96, 64), (64, 160)])}
    torch.set_num_threads(args.threads)
    bw = host_read_bandwidth(args.threads, 1 << 22 if args.smoke else 1 << 30)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s at {args.threads} threads; skyline bf16 kernel: "
          f"{cpu_bf16.isa() if cpu_bf16.available() else 'not built'}", flush=True)
    table = []
    for name, (layers, dims) in shapes.items():
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=g).to(torch.bfloat16)
                   for _ in range(layers) for n, k in dims]
        nbytes = sum(w.numel() * w.itemsize for w in weights)
        for kind in kinds:
            if kind == "skyline_bf16_huge_pages":
                if not host_memory.available():
                    continue
                fns = [kernel("skyline_bf16", w) for w in huge_pages(weights)]
            else:
                fns = [kernel(kind, w) for w in weights]
            if any(f is None for f in fns):
                continue
            for m in rows:
                t = time_step(fns, [w.shape[1] for w in weights], m, reps)
                table.append({"shapes": name, "kernel": kind, "rows": m, "ms": 1e3 * t,
                              "bytes": nbytes, "gb_per_s": nbytes / t / 1e9,
                              "floor_ratio": t / (nbytes / bw)})
                print(f"{name:8s} {kind:23s} rows {m:3d}: {1e3 * t:8.2f} ms, "
                      f"{nbytes / t / 1e9:6.1f} GB/s ({t / (nbytes / bw):4.2f}x floor)",
                      flush=True)
            del fns
    save_json({"bench": "cpu_bf16_speed", "date": datetime.date.today().isoformat(),
               "machine": machine_info("cpu"), "threads": args.threads,
               "bf16_isa": cpu_bf16.isa() if cpu_bf16.available() else None,
               # a CPU family emulated on this one: the kernel built for another -march, oneDNN
               # capped at another ISA, ATen's kernels at another capability
               "emulated": {k: os.environ[k] for k in EMULATION if k in os.environ},
               "read_bandwidth_gbs": bw / 1e9, "table": table}, args.out)


if __name__ == "__main__":
    main()
