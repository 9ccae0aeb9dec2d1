"""Instructions per weight in the inner loop of the INT4 tensor-core GEMV, read from the PTX
that Triton generates for sm_90, without a GPU (Triton compiles for a target it is told).

  python bench/kernels/gemv_ptx_count.py --out bench/results/kernels/gemv-int4-ptx-count.json
  python bench/kernels/gemv_ptx_count.py --smoke   # one tile

For each tile (BLOCK_N, warps, stages) and operand order (weights left, or X_LEFT), the kernel
of skyline/ops/gemv_quant_triton.py is compiled as the launcher would on an H200 (bf16 x, INT4
codes, group 128, split K, PTX unpacking) and the instructions of its inner loop are counted:
all of them, those of the unpacking routine (prmt, lop3, shr), and the shared-memory loads.
Per weight = count / (BLOCK_N * BLOCK_K / threads), the weights one thread handles per tile.
"""

from __future__ import annotations

import argparse

from skyline.bench.offline import save_json
from skyline.bench.ptx import compile_for_sm90, inner_loop, opcode

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8",
             "b_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
             "xs_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "k_iters": "i32",
             "num_splits": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32"}
# what the JIT assumes of real launches: pointers and the sizes / strides divisible by 16
DIVISIBLE = ["x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr", "part_ptr", "count_ptr",
             "xs_ptr", "N", "K", "stride_xm", "stride_wn", "stride_sn"]


def loop_ptx(block_n: int, warps: int, stages: int, x_left: bool) -> list[str]:
    """The instructions of the compiled kernel's first (main) loop."""
    from skyline.ops import gemv_quant_triton as kernels

    const = dict(WEIGHT_KIND=2, GROUP=128, HAS_BIAS=False, EVEN_K=True, SPLIT=True,
                 USE_DOT=True, IEEE=False, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128,
                 NUM_STAGES=stages, STATIC_ITERS=0, X_QUANT=0, XS_BLOCK=0, XS_STRIDE=1,
                 ROUND_E4M3=False, INT4_ASM=1, INT4_OFFSET=128.0, X_LEFT=x_left, PDL=False)
    compiled = compile_for_sm90(kernels.gemv_quant_kernel, SIGNATURE, const, DIVISIBLE, warps,
                                stages)
    return inner_loop(compiled.asm["ptx"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="one tile and operand order")
    a = ap.parse_args()
    rows = []
    for block_n, warps, stages in ((128, 4, 3),) if a.smoke else ((128, 4, 3), (256, 4, 3)):
        for x_left in (False,) if a.smoke else (False, True):
            ins = loop_ptx(block_n, warps, stages, x_left)
            per_thread = block_n * 128 // (32 * warps)  # weights a thread handles per tile
            ops = [opcode(i) for i in ins]
            row = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                   "X_LEFT": x_left, "loop_instructions": len(ins),
                   "unpack_instructions": sum(o.startswith(("prmt", "lop3", "shr"))
                                              for o in ops),
                   "shared_loads": sum(o.startswith(("ld.shared", "ldmatrix")) for o in ops),
                   "weights_per_thread": per_thread,
                   "instructions_per_weight": len(ins) / per_thread}
            rows.append(row)
            print(row, flush=True)
    save_json({"benchmark": "gemv_ptx_count", "target": "sm_90 (PTX, no GPU)",
               "kernel": "gemv_quant_kernel, INT4 g128, bf16, DOT + PTX unpacking",
               "results": rows}, a.out)


if __name__ == "__main__":
    main()
