"""Triton kernels of the block-scaled GEMV's tensor-core mode and of the dequantizer
(ops/gemv_block.py holds the references, configurations and launchers; the integer mode is
gemv_block_a8_triton.py): NVFP4 (FORMAT 0), GGUF Q6_K (1), Q5_K (2) and MXFP4 (3) read as
stored. Each
format has a tile function that turns the stored bytes of [BLOCK_N] rows and one K tile into
float32 weights [BLOCK_N, BLOCK_K]; the GEMV multiplies them by x on the tensor cores and ends
in gemv.py's split-K epilogue, the dequantizer stores them.

Tiles load each stored byte once, as the format lays it out, and spread it over the elements it
holds by broadcasting and a reshape (row-major, so element order is the format's):
- NVFP4 / MXFP4: BLOCK_K / 2 bytes (element 2j in the low nibble) and BLOCK_K / 16 E4M3 /
  BLOCK_K / 32 E8M0 scales. E2M1 is
  decoded without a table or a select: the 3 magnitude bits shifted under an fp16's exponent
  (bits 9-11) and the sign to bit 15 make the fp16 2^-14 * value (code 1 a subnormal), so the
  block scale carries the 2^14. NVFP4's per-row tensor scale multiplies the finished sum.
- Q6_K (210 bytes / 256 weights; a tile is one super-block): ql [2, 64] bytes give element
  128h + 64i + j from nibble i of byte 64h + j; qh [2, 32] give its 2 high bits from bits
  2s..2s+1 of byte 32h + j for element 128h + 32s + j; an int8 scale per 16 and the fp16 d.
  w = d * sc * (q - 32).
- Q5_K (176 bytes / 256; a tile is one super-block): qs [4, 32] give element 64c + 32i + j from
  nibble i of byte 32c + j, the 5th bit of element 32g + j is bit g of qh byte j; 6-bit scales
  and mins per 32 from 12 bytes (ggml's get_scale_min_k4). w = q * (d * sc) - dmin * mn.
The fp16 values (d, dmin) are read through an fp16 view of the same bytes (every offset even).
"""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.gemv import split_k_epilogue

    @triton.jit
    def _fp4_parts(w_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn, MX: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # rows [BLOCK_N] int64, n_ok [BLOCK_N] -> (2^-14 * e2m1 [BLOCK_N, BLOCK_K / GS, GS],
        # 2^14 * block scale [BLOCK_N, BLOCK_K / GS]), float32; GS 16 (NVFP4: E4M3 scales) or
        # 32 (MX, MXFP4: E8M0 scales, 2^(e - 127) made from its bits; e = 0 reads 0)
        GS: tl.constexpr = 32 if MX else 16
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_s = tl.arange(0, BLOCK_K // GS)
        b_mask = n_ok[:, None] & ((k0 + offs_b * 2) < K)[None, :]
        s_mask = n_ok[:, None] & ((k0 + offs_s * GS) < K)[None, :]
        byte = tl.load(w_ptr + rows[:, None] * stride_wn + k0 // 2 + offs_b[None, :],
                       mask=b_mask, other=0)
        s_at = s_ptr + rows[:, None] * stride_sn + k0 // GS + offs_s[None, :]
        if MX:
            ex = tl.load(s_at, mask=s_mask, other=0).to(tl.int32)
            scale = (ex << 23).to(tl.float32, bitcast=True) * 16384.0
        else:
            scale = tl.load(s_at, mask=s_mask, other=0.0).to(tl.float32) * 16384.0
        c = byte.to(tl.uint16)
        lo = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)
        hi = (((c & 0x70) << 5) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)
        vals = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // GS, GS)).to(tl.float32)
        return vals, scale

    @triton.jit
    def _q6_k_parts(w_ptr, h_ptr, rows, ok, blk, stride_wn, BLOCK_N: tl.constexpr):
        # one super-block of each of [BLOCK_N] rows -> (q - 32 [BLOCK_N, 16, 16],
        # d * sc [BLOCK_N, 16]), float32
        base = rows * stride_wn + blk * 210  # [BLOCK_N], even
        ok2 = ok[:, None, None]
        i2 = tl.arange(0, 2)
        j64 = tl.arange(0, 64)
        j32 = tl.arange(0, 32)
        ql = tl.load(w_ptr + base[:, None, None] + i2[None, :, None] * 64 + j64[None, None, :],
                     mask=ok2, other=0)  # [BLOCK_N, 2, 64]
        ql = (ql[:, :, None, :] >> (tl.arange(0, 2) * 4)[None, None, :, None]) & 0x0F
        qh = tl.load(w_ptr + base[:, None, None] + 128 + i2[None, :, None] * 32
                     + j32[None, None, :], mask=ok2, other=0)  # [BLOCK_N, 2, 32]
        qh = (qh[:, :, None, :] >> (tl.arange(0, 4) * 2)[None, None, :, None]) & 0x03
        q = (tl.reshape(ql, (BLOCK_N, 256)) | (tl.reshape(qh, (BLOCK_N, 256)) << 4))
        sc = tl.load(w_ptr + base[:, None] + 192 + tl.arange(0, 16)[None, :], mask=ok[:, None],
                     other=0).to(tl.int8, bitcast=True).to(tl.float32)  # [BLOCK_N, 16]
        d = tl.load(h_ptr + base // 2 + 104, mask=ok, other=0.0).to(tl.float32)
        dl = d[:, None] * sc
        return tl.reshape(q, (BLOCK_N, 16, 16)).to(tl.float32) - 32.0, dl

    @triton.jit
    def _q5_k_parts(w_ptr, h_ptr, rows, ok, blk, stride_wn, BLOCK_N: tl.constexpr):
        # one super-block of each of [BLOCK_N] rows -> (q [BLOCK_N, 8, 32], d * sc [BLOCK_N, 8],
        # -dmin * mn [BLOCK_N, 8]), float32
        base = rows * stride_wn + blk * 176  # [BLOCK_N], even
        ok2 = ok[:, None, None]
        j32 = tl.arange(0, 32)
        qs = tl.load(w_ptr + base[:, None, None] + 48 + tl.arange(0, 4)[None, :, None] * 32
                     + j32[None, None, :], mask=ok2, other=0)  # [BLOCK_N, 4, 32]
        ql = (qs[:, :, None, :] >> (tl.arange(0, 2) * 4)[None, None, :, None]) & 0x0F
        qh = tl.load(w_ptr + base[:, None] + 16 + j32[None, :], mask=ok[:, None], other=0)
        qh = (qh[:, None, :] >> tl.arange(0, 8)[None, :, None]) & 0x01  # [BLOCK_N, 8, 32]
        q = tl.reshape(ql, (BLOCK_N, 8, 32)) | (qh << 4)
        # 6-bit scale and min of group g (get_scale_min_k4): g < 4 from bytes g and 4 + g,
        # else the nibbles of byte 4 + g with the top 2 bits of bytes g - 4 and g.
        g = tl.arange(0, 8)
        lo4 = (g < 4)[None, :]
        sb = w_ptr + base[:, None] + 4
        a = tl.load(sb + tl.where(g < 4, g, g + 4)[None, :], mask=ok[:, None], other=0)
        m = tl.load(sb + (g + 4)[None, :], mask=ok[:, None], other=0)
        hs = tl.load(sb + tl.maximum(g - 4, 0)[None, :], mask=ok[:, None], other=0)
        hm = tl.load(sb + g[None, :], mask=ok[:, None], other=0)
        sc = tl.where(lo4, a & 63, (a & 0x0F) | ((hs >> 2) & 0x30)).to(tl.float32)
        mn = tl.where(lo4, m & 63, (m >> 4) | ((hm >> 2) & 0x30)).to(tl.float32)
        d = tl.load(h_ptr + base // 2, mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load(h_ptr + base // 2 + 1, mask=ok, other=0.0).to(tl.float32)
        return q.to(tl.float32), d[:, None] * sc, -(dmin[:, None] * mn)

    @triton.jit
    def _parts(w_ptr, h_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn,
               FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # A tile as (c [BLOCK_N, G, S], a [BLOCK_N, G], b [BLOCK_N, G]), float32: the weights
        # of group g are c * a + b (b = 0 but for Q5_K), so sum(w * x) over a group is
        # a * sum(c * x) + b * sum(x).
        # GGUF: K is whole super-blocks; a split's tile past it loads nothing (weights 0)
        ok = n_ok & ((rows * 0 + k0) < K)
        if FORMAT == 0 or FORMAT == 3:
            c, a = _fp4_parts(w_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn,
                              FORMAT == 3, BLOCK_N, BLOCK_K)
            b = a * 0.0
        elif FORMAT == 1:
            c, a = _q6_k_parts(w_ptr, h_ptr, rows, ok, k0 // 256, stride_wn, BLOCK_N)
            b = a * 0.0
        else:
            c, a, b = _q5_k_parts(w_ptr, h_ptr, rows, ok, k0 // 256, stride_wn, BLOCK_N)
        return c, a, b

    @triton.jit
    def _tile(w_ptr, h_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn,
              FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # the weights of a tile, float32 [BLOCK_N, BLOCK_K], as ops/fp4.py and ops/dequant.py
        # compute them
        c, a, b = _parts(w_ptr, h_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn,
                         FORMAT, BLOCK_N, BLOCK_K)
        if FORMAT == 2:
            w = c * a[:, :, None] + b[:, :, None]
        else:
            w = c * a[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    @triton.jit
    def gemv_block_kernel(
        x_ptr, w_ptr, h_ptr, s_ptr, ts_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, k_iters, num_splits, stride_xm, stride_wn, stride_sn,
        FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
        W_LO: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr,
    ):
        # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the K tiles
        # [pid_k * k_iters, +k_iters). The weight tile is rounded to x's dtype for the tensor
        # cores, and with W_LO the rounding error is added as a second operand (weights to
        # about 16 bits: GGUF's d * sc products are not exact in 16 bits; NVFP4's e2m1 * e4m3
        # are, so it needs none).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        rows = offs_n.to(tl.int64)
        k_start = pid_k * k_iters * BLOCK_K
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_start + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            k0 = k_start + it * BLOCK_K
            x_mask = m_mask[:, None] & ((k0 + offs_k) < K)[None, :]
            xv = tl.load(x_ptrs, mask=x_mask, other=0.0)
            w = _tile(w_ptr, h_ptr, s_ptr, rows, n_mask, k0, K, stride_wn, stride_sn,
                      FORMAT, BLOCK_N, BLOCK_K)
            wh = w.to(xv.dtype)
            if IEEE:
                acc = tl.dot(wh, tl.trans(xv), acc, input_precision="ieee")
            else:
                acc = tl.dot(wh, tl.trans(xv), acc)
                if W_LO:
                    acc = tl.dot((w - wh.to(tl.float32)).to(xv.dtype), tl.trans(xv), acc)
            x_ptrs += BLOCK_K
        out = acc
        if FORMAT == 0:  # NVFP4's tensor scale, one per row
            out = out * tl.load(ts_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)

    @triton.jit
    def dequant_block_kernel(
        w_ptr, h_ptr, s_ptr, ts_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
        FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # out [N, K] (x's dtype) = the weights of rows [pid_n * BLOCK_N, +BLOCK_N), columns
        # [pid_k * BLOCK_K, +BLOCK_K)
        pid_n = tl.program_id(0)
        k0 = tl.program_id(1) * BLOCK_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        rows = offs_n.to(tl.int64)
        w = _tile(w_ptr, h_ptr, s_ptr, rows, n_mask, k0, K, stride_wn, stride_sn,
                  FORMAT, BLOCK_N, BLOCK_K)
        if FORMAT == 0:
            w = w * tl.load(ts_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_on + offs_k[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])
