"""What the paged decode kernel's loop does per K/V tile, read from the PTX Triton generates
for sm_90, without a GPU (Triton compiles for a target it is told).

  python bench/kernels/attention_ptx_count.py --out bench/results/kernels/attention-ptx-count.json
  python bench/kernels/attention_ptx_count.py --smoke   # one cache and tile

The kernel of skyline/ops/attention_triton.py is compiled as the launcher would for the
Llama-3.1-8B shape (32 / 8 heads, head_dim 128, 16-token pages, bf16 queries, KV splits) with a
bf16 cache, an fp8 cache read as fp8 (FP8_WORDS=0) and an fp8 cache read as int32 words
(FP8_WORDS=2), for a four-warp and a one-warp tile. Counted in the loop: all instructions, the
byte-wide shared-memory loads (ld.shared.b8), ldmatrix, the e4m3 -> f16x2 conversions, and the
shared memory the kernel asks for (bounds how many programs an SM holds).
"""

from __future__ import annotations

import argparse

from skyline.bench.offline import save_json
from skyline.bench.ptx import compile_for_sm90, inner_loop, opcode

SIGNATURE = {"q_ptr": "*bf16", "k_ptr": None, "v_ptr": None, "out_ptr": "*bf16",
             "part_ml_ptr": "*fp32", "part_acc_ptr": "*fp32", "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "scale": "fp32", "v_scale": "fp32", "num_heads": "i32",
             "window": "i32", "sinks_ptr": "*fp32", "qsl_ptr": "*i32",
             "num_splits": "i32", "stride_qb": "i32", "stride_qh": "i32", "stride_kb": "i32",
             "stride_ks": "i32", "stride_kh": "i32", "stride_bt": "i32", "stride_ob": "i32",
             "stride_oh": "i32"}
# what the JIT assumes of real launches: pointers and strides divisible by 16
DIVISIBLE = [k for k in SIGNATURE if k.endswith("_ptr") or k.startswith("stride_")]
CACHES = {"bf16": ("bf16", 0), "fp8": ("fp8e4nv", 0), "fp8 words": ("fp8e4nv", 2)}


def compile_decode(cache: str, block_n: int, warps: int, stages: int):
    from skyline.ops import attention_triton as kernels

    kv, words = CACHES[cache]
    const = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_N=block_n,
                 IEEE=False, SPLIT=True, PIPELINE=True, NUM_STAGES=stages, F16=kv != "bf16",
                 PDL=False, FP8_WORDS=words, SINKS=False, VARLEN=False)
    sig = {**SIGNATURE, "k_ptr": f"*{kv}", "v_ptr": f"*{kv}"}
    return compile_for_sm90(kernels.paged_decode_kernel, sig, const, DIVISIBLE, warps, stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="one cache and tile")
    a = ap.parse_args()
    rows = []
    for block_n, warps, stages in ((64, 4, 3),) if a.smoke else ((64, 4, 3), (32, 1, 3)):
        for cache in list(CACHES)[:1] if a.smoke else CACHES:
            compiled = compile_decode(cache, block_n, warps, stages)
            ops = [opcode(i) for i in inner_loop(compiled.asm["ptx"])]
            row = {"cache": cache, "BLOCK_N": block_n, "num_warps": warps,
                   "num_stages": stages, "loop_instructions": len(ops),
                   "ld_shared_b8": sum(o == "ld.shared.b8" for o in ops),
                   "ldmatrix": sum(o.startswith("ldmatrix") for o in ops),
                   # the words path's conversions sit in inline-asm blocks of their own
                   "e4m3_conversions": compiled.asm["ptx"].count("cvt.rn.f16x2.e4m3x2"),
                   "shared_bytes": compiled.metadata.shared}
            rows.append(row)
            print(row, flush=True)
    save_json({"benchmark": "attention_ptx_count", "target": "sm_90 (PTX, no GPU)",
               "kernel": "paged_decode_kernel, Llama-3.1-8B shape, bf16 queries, splits",
               "results": rows}, a.out)


if __name__ == "__main__":
    main()
