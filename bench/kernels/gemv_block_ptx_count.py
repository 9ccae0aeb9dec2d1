"""Instructions per weight in the inner loop of the block-scaled GEMV (ops/gemv_block.py: NVFP4,
MXFP4, GGUF Q6_K and Q5_K), read from the PTX that Triton generates for sm_90, without a GPU (Triton
compiles for a target it is told; ptxas assembles it, so a kernel that does not build fails).

  python bench/kernels/gemv_block_ptx_count.py --out bench/results/kernels/gemv-block-ptx.json
  python bench/kernels/gemv_block_ptx_count.py --smoke   # two tiles of each format

For each format, mode (tensor cores, "dot", and the integer mode "a8" of
gemv_block_a8_triton.py) and BLOCK_N, the kernel is compiled as the launcher would on an H200
(bf16 x, BLOCK_K 256, split K, K a multiple of the tile) and the instructions of its inner loop
are counted: all of them, global loads, shared-memory traffic, cross-lane shuffles and dp4a.
Per weight = count / (BLOCK_N * BLOCK_K / threads), the weights one thread handles per tile.
The quantized INT4 FMA GEMV (gemv_ptx_count.py's neighbour) reads about 8-11 per weight at the
same tiles, for comparison.
"""

from __future__ import annotations

import argparse

from skyline.bench.offline import save_json
from skyline.bench.ptx import compile_for_sm90, inner_loop, opcode

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*u8", "h_ptr": "*fp16", "s_ptr": "*fp8e4nv",
             "ts_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_iters": "i32",
             "num_splits": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32"}
# what the JIT assumes of real launches: pointers, K and x's row stride divisible by 16 (a
# GGUF row of Q6_K blocks is not: 210 bytes a block)
DIVISIBLE = ["x_ptr", "w_ptr", "h_ptr", "s_ptr", "ts_ptr", "b_ptr", "y_ptr", "part_ptr",
             "count_ptr", "K", "stride_xm"]
FORMATS = {"nvfp4": 0, "q6_k": 1, "q5_k": 2, "mxfp4": 3}
A8_SIGNATURE = {"xq_ptr": "*i32", "xf_ptr": "*fp32", "w8_ptr": "*u8", "w16_ptr": "*i16",
                "w32_ptr": "*i32", "s_ptr": "*u8", "ts_ptr": "*u8", "b_ptr": "*bf16",
                "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32",
                "N": "i32", "KP": "i32", "KC": "i32", "k_iters": "i32", "num_splits": "i32",
                "stride_w": "i32", "stride_sn": "i32"}
A8_DIVISIBLE = ["xq_ptr", "xf_ptr", "w8_ptr", "w16_ptr", "w32_ptr", "s_ptr", "ts_ptr", "b_ptr",
                "y_ptr", "part_ptr", "count_ptr"]
# (mode, BLOCK_N, BLOCK_M, num_warps)
TILES = [("dot", 32, 16, 4), ("a8", 4, 1, 1), ("a8", 4, 2, 1)]


def loop_ptx(fmt: int, mode: str, block_n: int, block_m: int, warps: int) -> list[str]:
    """The instructions of the compiled kernel's main loop."""
    from skyline.ops import gemv_block_a8_triton as a8_kernels
    from skyline.ops import gemv_block_triton as kernels

    if mode == "a8":
        sig = dict(A8_SIGNATURE)
        if fmt in (0, 3):  # x as int64s of eight columns
            sig |= {"xq_ptr": "*i64", "ts_ptr": "*fp32"}
        if fmt == 0:  # NVFP4's E4M3 scales (MXFP4's E8M0 are bytes)
            sig |= {"s_ptr": "*fp8e4nv"}
        # a GGUF row of Q6_K blocks is not a multiple of 16 bytes
        divisible = A8_DIVISIBLE + (["stride_w", "KP"] if fmt != 1 else [])
        const = dict(FORMAT=fmt, HAS_BIAS=False, SPLIT=True, EVEN_K=True, BLOCK_M=block_m,
                     BLOCK_N=block_n, BLOCK_K=256, NUM_STAGES=1, STATIC_ITERS=0, ASM=True,
                     PDL=False)
        compiled = compile_for_sm90(a8_kernels.gemv_block_a8_kernel, sig, const, divisible,
                                    warps, 1)
        return inner_loop(compiled.asm["ptx"])
    assert mode == "dot"
    sig = dict(SIGNATURE)
    if fmt:  # GGUF: the scales live in the blocks; MXFP4's are E8M0 bytes
        sig |= {"s_ptr": "*u8", "ts_ptr": "*u8"}
    const = dict(FORMAT=fmt, HAS_BIAS=False, SPLIT=True, W_LO=fmt != 0, IEEE=False,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=256, NUM_STAGES=2, STATIC_ITERS=0)
    compiled = compile_for_sm90(kernels.gemv_block_kernel, sig, const, DIVISIBLE, warps, 2)
    return inner_loop(compiled.asm["ptx"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="two tiles of each format")
    a = ap.parse_args()
    rows = []
    for name, fmt in FORMATS.items():
        for mode, block_n, block_m, warps in TILES[:2] if a.smoke else TILES:
            ops = [opcode(i) for i in loop_ptx(fmt, mode, block_n, block_m, warps)]
            per_thread = block_n * 256 // (32 * warps)
            row = {"format": name, "mode": mode, "BLOCK_N": block_n, "rows": block_m,
                   "num_warps": warps, "loop_instructions": len(ops),
                   "global_loads": sum(o.startswith("ld.global") for o in ops),
                   "shared": sum(o.startswith(("ld.shared", "st.shared", "ldmatrix",
                                               "stmatrix")) for o in ops),
                   "shuffles": sum(o.startswith("shfl") for o in ops),
                   "dp4a": sum(o.startswith("dp4a") for o in ops),
                   "weights_per_thread": per_thread,
                   "instructions_per_weight": len(ops) / per_thread}
            rows.append(row)
            print(row, flush=True)
    save_json({"benchmark": "gemv_block_ptx_count", "target": "sm_90 (PTX, no GPU)",
               "kernel": "gemv_block_kernel, bf16 x, BLOCK_K 256", "results": rows}, a.out)


if __name__ == "__main__":
    main()
