"""Triton kernels of the block-scaled GEMV and dequantizer (ops/gemv_block.py holds the
references, configurations and launchers): NVFP4 (FORMAT 0), GGUF Q6_K (1) and Q5_K (2) read
as stored. Each format has a tile function that turns the stored bytes of [BLOCK_N] rows and
one K tile into float32 weights [BLOCK_N, BLOCK_K]; the GEMV multiplies them by x (FMA or
tensor cores) and ends in gemv.py's split-K epilogue, the dequantizer stores them.

Tiles load each stored byte once, as the format lays it out, and spread it over the elements it
holds by broadcasting and a reshape (row-major, so element order is the format's):
- NVFP4: BLOCK_K / 2 bytes (element 2j in the low nibble) and BLOCK_K / 16 E4M3 scales. E2M1 is
  decoded without a table or a select: the 3 magnitude bits shifted under an fp16's exponent
  (bits 9-11) and the sign to bit 15 make the fp16 2^-14 * value (code 1 a subnormal), so the
  block scale carries the 2^14. The per-row tensor scale multiplies the finished sum.
- Q6_K (210 bytes / 256 weights; a tile is one super-block): ql [2, 64] bytes give element
  128h + 64i + j from nibble i of byte 64h + j; qh [2, 32] give its 2 high bits from bits
  2s..2s+1 of byte 32h + j for element 128h + 32s + j; an int8 scale per 16 and the fp16 d.
  w = d * sc * (q - 32).
- Q5_K (176 bytes / 256; a tile is one super-block): qs [4, 32] give element 64c + 32i + j from
  nibble i of byte 32c + j, the 5th bit of element 32g + j is bit g of qh byte j; 6-bit scales
  and mins per 32 from 12 bytes (ggml's get_scale_min_k4). w = q * (d * sc) - dmin * mn.
The fp16 values (d, dmin) are read through an fp16 view of the same bytes (every offset even).

The GEMV's FMA mode (1..2 rows by default) does not build the weight tile: the *_fma functions
load bytes and x in the format's own lanes (the elements that share a scale along the last axis)
and sum each group's code * x products before its scale applies (ptxas-checked for sm_90 with
skyline/bench/ptx.py: 1.2x fewer loop instructions than scaling every weight for Q6_K, 1.9x for
Q5_K). DOT mode and the dequantizer use the tiles above.
"""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.gemv import split_k_epilogue

    @triton.jit
    def _nvfp4_parts(w_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # rows [BLOCK_N] int64, n_ok [BLOCK_N] -> (2^-14 * e2m1 [BLOCK_N, BLOCK_K / 16, 16],
        # 2^14 * block scale [BLOCK_N, BLOCK_K / 16]), float32
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_s = tl.arange(0, BLOCK_K // 16)
        b_mask = n_ok[:, None] & ((k0 + offs_b * 2) < K)[None, :]
        s_mask = n_ok[:, None] & ((k0 + offs_s * 16) < K)[None, :]
        byte = tl.load(w_ptr + rows[:, None] * stride_wn + k0 // 2 + offs_b[None, :],
                       mask=b_mask, other=0)
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + k0 // 16 + offs_s[None, :],
                        mask=s_mask, other=0.0).to(tl.float32) * 16384.0
        c = byte.to(tl.uint16)
        lo = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)
        hi = (((c & 0x70) << 5) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)
        vals = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // 16, 16)).to(tl.float32)
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
        if FORMAT == 0:
            c, a = _nvfp4_parts(w_ptr, s_ptr, rows, n_ok, k0, K, stride_wn, stride_sn,
                                BLOCK_N, BLOCK_K)
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

    # FMA mode: the tile's products summed over each group of elements that share a scale
    # before the scale applies, -> [BLOCK_N, BLOCK_M, groups] float32. Bytes and x are loaded
    # in the format's own order (a group's elements along the last, per-thread axis), so the
    # sums stay in registers and no reshape moves data between threads.

    @triton.jit
    def _nvfp4_fma(x_ptr, w_ptr, s_ptr, rows, n_ok, offs_m, m_ok, k0, K, stride_xm, stride_wn,
                   stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr):
        # EVEN_K: every tile lies inside K, so the masks are per row alone and constant along
        # a row's bytes, which lets the loads be vectors
        G: tl.constexpr = BLOCK_K // 16
        g = tl.arange(0, G)
        j = tl.arange(0, 8)
        col = k0 + g[:, None] * 16 + j[None, :] * 2  # [G, 8]: the even element of byte j
        w_mask = n_ok[:, None, None]
        s_mask = n_ok[:, None]
        xe_mask = m_ok[:, None, None]
        xo_mask = xe_mask
        if not EVEN_K:
            w_mask = w_mask & (col < K)[None, :, :]
            s_mask = s_mask & ((k0 + g * 16) < K)[None, :]
            xe_mask = xe_mask & (col < K)[None, :, :]
            xo_mask = xo_mask & (col + 1 < K)[None, :, :]
        byte_at = k0 // 2 + g[:, None] * 8 + j[None, :]  # contiguous along j: vector loads
        byte = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte_at[None, :, :],
                       mask=w_mask, other=0)
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + k0 // 16 + g[None, :],
                        mask=s_mask, other=0.0).to(tl.float32) * 16384.0  # [BN, G]
        c = byte.to(tl.uint16)
        lo = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((c & 0x70) << 5) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        x_at = x_ptr + offs_m[:, None, None] * stride_xm + col[None, :, :]
        xe = tl.load(x_at, mask=xe_mask, other=0.0)
        xo = tl.load(x_at + 1, mask=xo_mask, other=0.0)
        part = tl.sum(lo[:, None, :, :] * xe.to(tl.float32)[None, :, :, :]
                      + hi[:, None, :, :] * xo.to(tl.float32)[None, :, :, :], axis=3)
        return part * scale[:, None, :]

    @triton.jit
    def _q6_k_fma(x_ptr, w_ptr, h_ptr, rows, ok, offs_m, m_ok, k0, stride_xm, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        # Byte lane (h, t, u), j = 16t + u < 32 of half h, holds elements 128h + 32s + j,
        # s = 0..3: low nibbles of ql[64h + j] (s 0) and ql[64h + 32 + j] (s 1), their high
        # nibbles (s 2, 3), bits 2s..2s+1 of qh[32h + j]; their scale is sc[8h + 2s + t].
        base = rows * stride_wn + (k0 // 256) * 210  # [BN]
        h = tl.arange(0, 2)[:, None, None]
        t = tl.arange(0, 2)[None, :, None]
        u = tl.arange(0, 16)[None, None, :]
        j = t * 16 + u  # [1, 2, 16]
        b3 = base[:, None, None, None]
        ok4 = ok[:, None, None, None]
        ql0 = tl.load(w_ptr + b3 + (h * 64 + j)[None], mask=ok4, other=0)  # [BN, 2, 2, 16]
        ql1 = tl.load(w_ptr + b3 + (h * 64 + 32 + j)[None], mask=ok4, other=0)
        qh = tl.load(w_ptr + b3 + (128 + h * 32 + j)[None], mask=ok4, other=0)
        d = tl.load(h_ptr + base // 2 + 104, mask=ok, other=0.0).to(tl.float32)
        gs = tl.arange(0, 2)[:, None] * 8 + tl.arange(0, 2)[None, :]  # [2, 2]: 8h + t
        sc_at = w_ptr + base[:, None, None] + 192 + gs[None, :, :]  # [BN, 2, 2]
        x_at = (x_ptr + offs_m[:, None, None, None] * stride_xm + k0
                + (h * 128 + j)[None])  # [BM, 2, 2, 16]
        m4 = m_ok[:, None, None, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M, 2, 2), dtype=tl.float32)
        for s in tl.static_range(4):
            lo = ql0 if s % 2 == 0 else ql1
            q = ((lo >> (4 * (s // 2))) & 0x0F) | (((qh >> (2 * s)) & 0x03) << 4)
            xv = tl.load(x_at + 32 * s, mask=m4, other=0.0).to(tl.float32)
            part = tl.sum((q.to(tl.float32) - 32.0)[:, None] * xv[None], axis=4)
            sc = tl.load(sc_at + 2 * s, mask=ok[:, None, None], other=0)
            dl = d[:, None, None] * sc.to(tl.int8, bitcast=True).to(tl.float32)  # [BN, 2, 2]
            acc += part * dl[:, None, :, :]
        return tl.reshape(acc, (BLOCK_N, BLOCK_M, 4))

    @triton.jit
    def _q5_k_fma(x_ptr, w_ptr, h_ptr, rows, ok, offs_m, m_ok, k0, stride_xm, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        # Byte lane (c, j) of qs holds elements 64c + j (low nibble, group 2c) and 64c + 32 + j
        # (high, group 2c + 1); their 5th bits are bits 2c and 2c + 1 of qh[j].
        base = rows * stride_wn + (k0 // 256) * 176  # [BN]
        cc = tl.arange(0, 4)
        j = tl.arange(0, 32)
        ok3 = ok[:, None, None]
        qs = tl.load(w_ptr + base[:, None, None] + 48 + (cc[:, None] * 32 + j[None, :])[None],
                     mask=ok3, other=0)  # [BN, 4, 32]
        qh = tl.load(w_ptr + base[:, None, None] + 16 + j[None, None, :], mask=ok3, other=0)
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
        scale = tl.reshape(d[:, None] * sc, (BLOCK_N, 4, 2))  # group 2c + i at [c, i]
        offset = tl.reshape(-(dmin[:, None] * mn), (BLOCK_N, 4, 2))
        x_at = (x_ptr + offs_m[:, None, None] * stride_xm + k0
                + (cc[:, None] * 64 + j[None, :])[None])  # [BM, 4, 32]
        m3 = m_ok[:, None, None]
        sh = (2 * cc)[None, :, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M, 4), dtype=tl.float32)
        for i in tl.static_range(2):
            q = ((qs >> (4 * i)) & 0x0F) | (((qh >> (sh + i)) & 0x01) << 4)  # [BN, 4, 32]
            xv = tl.load(x_at + 32 * i, mask=m3, other=0.0).to(tl.float32)  # [BM, 4, 32]
            part = tl.sum(q.to(tl.float32)[:, None] * xv[None], axis=3)  # [BN, BM, 4]
            xs = tl.sum(xv, axis=2)  # [BM, 4]
            si, oi = _pick(scale, i), _pick(offset, i)  # [BN, 4]
            acc += part * si[:, None, :] + xs[None, :, :] * oi[:, None, :]
        return acc

    @triton.jit
    def _pick(t, i: tl.constexpr):
        # t [BN, 4, 2] -> t[:, :, i]
        a, b = tl.split(t)
        if i == 0:
            return a
        return b

    @triton.jit
    def gemv_block_kernel(
        x_ptr, w_ptr, h_ptr, s_ptr, ts_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, k_iters, num_splits, stride_xm, stride_wn, stride_sn,
        FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
        USE_DOT: tl.constexpr, W_LO: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr,
    ):
        # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the K tiles
        # [pid_k * k_iters, +k_iters). FMA mode (the *_fma functions) multiplies x by the
        # codes as floats and sums each group that shares a scale before the scale (and Q5_K's
        # offset, against the group's sum of x) applies once: a [BLOCK_N, BLOCK_M, G] float32
        # sum, nothing scaled per weight. DOT mode rounds the weight tile to x's dtype for the
        # tensor cores, and with W_LO adds the rounding error as a second operand (weights to
        # about 16 bits: GGUF's d * sc products are not exact in 16 bits; NVFP4's e2m1 * e4m3
        # are, so it needs one).
        G: tl.constexpr = BLOCK_K // 16 if FORMAT == 0 else 4  # FMA mode's group sums
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
        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M, G), dtype=tl.float32)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            k0 = k_start + it * BLOCK_K
            if not USE_DOT:
                # GGUF: K is whole super-blocks; a split's tile past it reads no weights, and
                # no x (zero weights times x past the end could still make NaN)
                ok = n_mask & ((offs_n * 0 + k0) < K)
                mk = m_mask & ((offs_m * 0 + k0) < K)
                if FORMAT == 0:
                    acc += _nvfp4_fma(x_ptr, w_ptr, s_ptr, rows, n_mask, offs_m, m_mask, k0, K,
                                      stride_xm, stride_wn, stride_sn, BLOCK_N, BLOCK_K, EVEN_K)
                elif FORMAT == 1:
                    acc += _q6_k_fma(x_ptr, w_ptr, h_ptr, rows, ok, offs_m, mk, k0,
                                     stride_xm, stride_wn, BLOCK_N, BLOCK_M)
                else:
                    acc += _q5_k_fma(x_ptr, w_ptr, h_ptr, rows, ok, offs_m, mk, k0,
                                     stride_xm, stride_wn, BLOCK_N, BLOCK_M)
            else:
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
        if USE_DOT:
            out = acc
        else:
            out = tl.sum(acc, axis=2)
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
