"""The measurements behind ops/cpu_plan.py: for each x86 family, how long the default model's
Linears take on each CPU kernel, by rows, with the weights streamed from memory as in a decode
step (30 layers of qkv / o / gate_up / down, 576 wide; no other work).

    python bench/cpu_kernel_plan.py [--threads 1,2] [--rows 1,2,4,8,16,64]
        [--out bench/results/cpu/kernel-plan.json]
    python bench/cpu_kernel_plan.py --smoke

Families are emulated on this machine in child processes: ATEN_CPU_CAPABILITY lowers the ISA
ATen's kernels (the int4 kernel among them) are dispatched to, ONEDNN_MAX_CPU_ISA the ISA
oneDNN's products use (AVX512_CORE_VNNI: AVX-512 without BF16, where oneDNN emulates bf16).
AMX cannot be emulated on a machine without it. Kernels: the int4 kernel with one plane (4-bit
codes) and two (5- to 8-bit codes), oneDNN-packed dense float32, and dense bfloat16 where the
family has it natively. Each cell is the median of --reps passes over all 30 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# family -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, bf16 native)
FAMILIES = {
    "avx512_bf16": ("avx512", "AVX512_CORE_BF16", True),
    "avx512": ("avx512", "AVX512_CORE_VNNI", False),
    "avx2": ("avx2", "AVX2", False),
}
# the torch.cpu.get_capabilities() flags a family needs on this machine (a lower ISA can be
# emulated, a higher one cannot: its instructions would fault)
NEEDS = {"avx512_bf16": ("avx512_bf16", "avx512_vnni"), "avx512": ("avx512_f", "avx512_vnni"),
         "avx2": ("avx2",)}
LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down


def one_pass(weights: list, call: Any, xs: dict) -> None:
    for layer in weights:
        for (_, k), w in zip(SHAPES, layer, strict=True):
            call(w, xs[k])


def child(rows: list[int], threads: int, bf16: bool, reps: int) -> dict[str, dict[int, float]]:
    """Seconds per pass over the layers, per kernel and rows (run in the emulating process)."""
    import torch

    torch.set_num_threads(threads)

    def int4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        return packed, (torch.randn(k // 32, n, 2) * 0.01).to(torch.bfloat16)

    def dense(dtype: torch.dtype):
        return lambda n, k: torch.ops.mkldnn._reorder_linear_weight(
            (torch.randn(n, k) * 0.02).to(dtype), None)

    def planes_call(ws: list, x: torch.Tensor) -> None:
        xb = x.to(torch.bfloat16)
        for packed, sz in ws:
            torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz)

    def dense_call(w: torch.Tensor, x: torch.Tensor) -> None:
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    act = torch.bfloat16 if bf16 else torch.float32
    kernels: dict[str, tuple[Any, Any, torch.dtype]] = {
        "int4_one_plane": (lambda n, k: [int4(n, k)], planes_call, act),
        "int4_two_planes": (lambda n, k: [int4(n, k), int4(n, k)], planes_call, act),
        "dense_fp32": (dense(torch.float32), dense_call, torch.float32),
    }
    if bf16:
        kernels["dense_bf16"] = (dense(torch.bfloat16), dense_call, torch.bfloat16)
    out: dict[str, dict[int, float]] = {}
    for name, (make, call, dtype) in kernels.items():
        weights = [[make(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
        out[name] = {}
        for m in rows:
            xs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
            one_pass(weights, call, xs)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                one_pass(weights, call, xs)
                times.append(time.perf_counter() - t)
            out[name][m] = statistics.median(times)
        del weights
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default="bench/results/cpu/kernel-plan.json")
    ap.add_argument("--smoke", action="store_true", help="one family, 1 thread, rows 1 and 16")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child is not None:
        rows, threads, bf16 = json.loads(ns.child)
        print(json.dumps(child(rows, threads, bf16, ns.reps)))
        return
    import torch

    flags = getattr(torch.cpu, "get_capabilities", dict)()
    if ns.smoke:  # the highest family without native bf16 that this machine can run
        fam = "avx512" if all(flags.get(f, False) for f in NEEDS["avx512"]) else "avx2"
        ns.families, ns.threads, ns.rows, ns.reps = fam, "1", "1,16", 2
    rows = [int(r) for r in ns.rows.split(",")]
    report: dict[str, Any] = {
        "benchmark": "cpu-kernel-plan", "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python " + " ".join(sys.argv), "layers": LAYERS, "shapes": SHAPES,
        "load_avg_at_start": os.getloadavg(), "seconds_per_pass": {},
    }
    for fam in ns.families.split(","):
        aten, onednn, bf16 = FAMILIES[fam]
        if not all(flags.get(f, False) for f in NEEDS[fam]):
            print(f"{fam}: this machine lacks {', '.join(NEEDS[fam])} to measure it on",
                  flush=True)
            continue
        env = dict(os.environ, ATEN_CPU_CAPABILITY=aten, ONEDNN_MAX_CPU_ISA=onednn)
        for threads in [int(t) for t in ns.threads.split(",")]:
            arg = json.dumps([rows, threads, bf16])
            proc = subprocess.run([sys.executable, __file__, "--child", arg, "--reps",
                                   str(ns.reps)], env=env, check=True, capture_output=True,
                                  text=True)
            cell = json.loads(proc.stdout.strip().splitlines()[-1])
            report["seconds_per_pass"][f"{fam}/{threads}t"] = cell
            best = {m: min(cell, key=lambda k: cell[k][str(m)]) for m in rows}
            print(f"{fam} {threads} thread(s): fastest by rows {best}", flush=True)
            for name, by_rows in cell.items():
                print(f"  {name:<16} " + " ".join(f"{m}:{1e3 * by_rows[str(m)]:6.2f}ms"
                                                  for m in rows), flush=True)
    report["load_avg_at_end"] = os.getloadavg()
    if not ns.smoke:
        os.makedirs(os.path.dirname(ns.out), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"-> {ns.out}")


if __name__ == "__main__":
    main()
