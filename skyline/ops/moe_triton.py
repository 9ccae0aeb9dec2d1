"""Triton kernels of the MoE's grouped GEMM (ops/moe.py holds its PyTorch reference, its launcher
and the layouts): one program per (block of BLOCK_M pairs of one expert, BLOCK_N output
columns), the weight tile dequantized in registers (fp8; MXFP4 by byte permutes in PTX with
bf16 activations on a GPU, else by float operations) before a bf16/fp32 dot; and
the decoding of a layer's stacked MXFP4 experts to bf16 before dense grouped GEMMs at large
pair counts (reference ops/fp4.py's dequantize_mxfp4)."""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:

    @triton.jit
    def _e2m1_to_f32_scaled(code):
        # uint8 E2M1 codes (< 16) -> their value times 2^-14, through fp16's bits: the sign
        # to bit 15, the two exponent bits to the exponent's low two, the mantissa bit to
        # the mantissa's top (code 1, 0.5, lands on fp16's subnormal 2^-15). Five integer
        # operations, where building fp32's bits takes about a dozen; the caller folds 2^14
        # into the E8M0 scale.
        c = code.to(tl.int16)
        bits = ((c & 8) << 12) | ((c & 7) << 9)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _e8m0_to_f32(s):
        # uint8 E8M0 exponents -> 2^(s - 127) as float32 bits (s = 0 reads as 0, not 2^-127)
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)

    # Four bytes of MXFP4 codes ($4, pack=4) and their four bf16 scales ($5, $6) -> the low
    # nibbles' four bf16 values ($0, $1) and the high nibbles' ($2, $3) in 27 instructions
    # (the grouped GEMM's main loop: 5.4 instructions a weight value on sm_90, from 8.5 through
    # _e2m1_to_f32_scaled, 1.43x faster on an H100): each code's magnitude (bits 0-2, a
    # byte permute's selector) looks up the low and the high byte of its bf16 value (0, 0.5,
    # 1, 1.5, 2, 3, 4, 6) in two tables of eight bytes; two more permutes interleave them
    # into pairs, the sign bits are or-ed in, and one bf16x2 fma (plus -0) per pair scales them
    # exactly (the scales are powers of two). bf16x2 fma needs sm_80.
    _E2M1_BF16 = tl.constexpr("""
    {
    .reg .b32 tl0, tl1, th0, th1, z, nz, m, mh, la, ha, lb, hb, s, xa, xb, t0, t1, t2, t3;
    mov.b32 tl0, 0xC0800000;
    mov.b32 tl1, 0xC0804000;
    mov.b32 th0, 0x3F3F3F00;
    mov.b32 th1, 0x40404040;
    mov.b32 z, 0;
    mov.b32 nz, 0x80008000;
    and.b32 m, $4, 0x77777777;
    shr.b32 mh, m, 16;
    prmt.b32 la, tl0, tl1, m;
    prmt.b32 ha, th0, th1, m;
    prmt.b32 lb, tl0, tl1, mh;
    prmt.b32 hb, th0, th1, mh;
    prmt.b32 t0, la, ha, 0x6240;
    prmt.b32 t1, lb, hb, 0x6240;
    prmt.b32 t2, la, ha, 0x7351;
    prmt.b32 t3, lb, hb, 0x7351;
    and.b32 s, $4, 0x88888888;
    prmt.b32 xa, s, z, 0x1404;
    prmt.b32 xb, s, z, 0x3424;
    shl.b32 m, xa, 4;
    and.b32 m, m, 0x80008000;
    or.b32 t0, t0, m;
    shl.b32 mh, xb, 4;
    and.b32 mh, mh, 0x80008000;
    or.b32 t1, t1, mh;
    and.b32 xa, xa, 0x80008000;
    or.b32 t2, t2, xa;
    and.b32 xb, xb, 0x80008000;
    or.b32 t3, t3, xb;
    fma.rn.bf16x2 $0, t0, $5, nz;
    fma.rn.bf16x2 $1, t1, $6, nz;
    fma.rn.bf16x2 $2, t2, $5, nz;
    fma.rn.bf16x2 $3, t3, $6, nz;
    }
    """)

    @triton.jit
    def _k_tile(acc, k0, a_ptr, a_rows, row_ok, stride_am, w_base, stride_wk, s_base, n, n_ok,
                stride_sn, stride_sk, K, FMT: tl.constexpr, CHANNEL_SCALE: tl.constexpr,
                SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                ASM: tl.constexpr):
        # acc [BLOCK_M, BLOCK_N] += a[a_rows, k0:k0 + BLOCK_K] @ W_e[n, k0:k0 + BLOCK_K]^T
        if FMT == 2:
            # bytes j of the tile hold elements 2j (low nibble) and 2j + 1 (high): two dots,
            # over a's even and odd columns (a's tile loaded contiguous, split in registers);
            # one scale per 16 bytes of a column, loaded once and spread over them
            j = tl.arange(0, BLOCK_K // 2)
            # masked by bytes (j), not values (2j): Triton then sees runs of bytes masked alike
            # and vectorizes their loads
            w_mask = (j < K // 2 - k0 // 2)[:, None] & n_ok[None, :]
            byte = tl.load(w_base + (k0 // 2 + j)[:, None] * stride_wk, mask=w_mask,
                           other=0)  # [BLOCK_K / 2, BLOCK_N]
            g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(s_base + n[None, :] * stride_sn + g[:, None] * stride_sk,
                        mask=(g * 32 < K)[:, None] & n_ok[None, :], other=0)  # [BK / 32, BN]
            if ASM:  # 2^(s - 127) as bf16: s in the exponent's bits
                scale = (s.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
            else:
                scale = _e8m0_to_f32(s) * 16384.0  # 2^14: see the decode
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :],
                                               (BLOCK_K // 32, 16, BLOCK_N)),
                               (BLOCK_K // 2, BLOCK_N))
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                        mask=row_ok[:, None] & (k < K)[None, :], other=0.0)  # [BM, BK]
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            if ASM:
                w_lo, w_hi = tl.inline_asm_elementwise(
                    _E2M1_BF16, "=r,=r,=r,=r,r,r,r", [byte, scale],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                w_lo = (_e2m1_to_f32_scaled(byte & 0x0F) * scale).to(a.dtype)
                w_hi = (_e2m1_to_f32_scaled(byte >> 4) * scale).to(a.dtype)
            if IEEE:
                acc += tl.dot(a_even, w_lo, input_precision="ieee")
                acc += tl.dot(a_odd, w_hi, input_precision="ieee")
            else:
                acc += tl.dot(a_even, w_lo)
                acc += tl.dot(a_odd, w_hi)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w = tl.load(w_base + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                        other=0)  # [BK, BN]
            if FMT == 1:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                if not CHANNEL_SCALE:  # the tile's columns share one scale block
                    w = w * tl.load(s_base + (n // SCALE_BN) * stride_sn
                                    + (k0 // SCALE_BK) * stride_sk, mask=n_ok,
                                    other=0.0)[None, :]
                w = w.to(a.dtype)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        return acc

    @triton.jit
    def grouped_matmul_kernel(
        a_ptr, w_ptr, s_ptr, b_ptr, out_ptr, route_ptr, sorted_ids_ptr, block_experts_ptr,
        N, K, num_pairs,
        stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be,
        stride_om,
        GATHER: tl.constexpr, FMT: tl.constexpr, CHANNEL_SCALE: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr, ASM: tl.constexpr, PIPELINE: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        # Rows: the pairs sorted_ids[pid_m * BLOCK_M ...] (P = padding), all of expert e, whose
        # inputs are rows pair // GATHER of a. FMT 0: W [E, N, K] in a's dtype; 1: e4m3 bytes
        # with a scale per output channel [E, N] (CHANNEL_SCALE) or per SCALE_BN x SCALE_BK
        # block (BLOCK_K divides SCALE_BK); 2: MXFP4, bytes [E, N, K / 2] and E8M0 scales
        # [E, N, K / 32]. The bias and the routing weight (ROUTE) apply after the product.
        # K tiles stream through a software-pipelined loop (PIPELINE), a while loop in
        # Triton's interpreter, which cannot run range() to a runtime bound.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_experts_ptr + pid_m)
        if e < 0:  # blocks past the last expert's
            return
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = rows < num_pairs
        a_rows = (rows // GATHER).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_base = w_ptr + e.to(tl.int64) * stride_we + n[None, :] * stride_wn
        s_base = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PIPELINE:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                acc = _k_tile(acc, k0, a_ptr, a_rows, row_ok, stride_am, w_base, stride_wk,
                              s_base, n, n_ok, stride_sn, stride_sk, K, FMT, CHANNEL_SCALE,
                              SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K,
                              IEEE, ASM)
        else:
            k0 = 0
            while k0 < K:
                acc = _k_tile(acc, k0, a_ptr, a_rows, row_ok, stride_am, w_base, stride_wk,
                              s_base, n, n_ok, stride_sn, stride_sk, K, FMT, CHANNEL_SCALE,
                              SCALE_BN, SCALE_BK, BLOCK_M, BLOCK_N, BLOCK_K,
                              IEEE, ASM)
                k0 += BLOCK_K
        if CHANNEL_SCALE:
            acc = acc * tl.load(s_base + n * stride_sn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok,
                           other=0.0).to(tl.float32)[None, :]
        if ROUTE:
            acc = acc * tl.load(route_ptr + rows, mask=row_ok, other=0.0)[:, None]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def dequant_mxfp4_kernel(w_ptr, s_ptr, out_ptr, rows, K, stride_wr, stride_sr, stride_or,
                             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # MXFP4 rows (codes [rows, K / 2], E8M0 scales [rows, K / 32]) -> out [rows, K] in out's
        # dtype; one program per BLOCK_R rows x BLOCK_K columns (reference: ops/fp4.py's
        # dequantize_mxfp4)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        r_ok = r < rows
        byte = tl.load(w_ptr + r.to(tl.int64)[:, None] * stride_wr + j[None, :],
                       mask=r_ok[:, None] & (2 * j < K)[None, :], other=0)
        w = tl.reshape(tl.join(_e2m1_to_f32_scaled(byte & 0x0F),
                               _e2m1_to_f32_scaled(byte >> 4)), (BLOCK_R, BLOCK_K))
        g = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        scale = _e8m0_to_f32(tl.load(s_ptr + r.to(tl.int64)[:, None] * stride_sr + g[None, :],
                                     mask=r_ok[:, None] & (g * 32 < K)[None, :], other=0))
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None] * 16384.0,
                                           (BLOCK_R, BLOCK_K // 32, 32)), (BLOCK_R, BLOCK_K))
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_or + k[None, :],
                 (w * scale).to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (k < K)[None, :])
