"""Triton kernels of the block-scaled GEMV's integer mode (ops/gemv_block.py holds the references,
configurations and launchers): NVFP4 (FORMAT 0), GGUF Q6_K (1) and Q5_K (2) against x rounded to
int8 per 32 columns, by `dp4a`, as llama.cpp's quantized GEMVs take q8_1 activations.

x comes as int32 words of four consecutive int8 columns [M, 8 KC] and per chunk of 32 columns
its scale and scale * sum of codes [M, KC, 2] (quantize_x_q8_kernel). A weight word (four codes,
one byte each, in column order) meets the word of x over the same columns in one `dp4a`; the
words of a group that shares a scale add up exactly in int32, then the group's scale times x's
chunk scale turns the sum into a float32 partial. Per format, what a thread turns into words:
- Q6_K (210 bytes / 256; 2-byte aligned, so words are two 16-bit loads): for half h and word
  lane w (columns 4w..4w+3 of each 32), ql words A = ql[64h + 4w] and B = ql[64h + 32 + 4w] and
  qh word H = qh[32h + 4w] give the four words of columns 128h + 32s + 4w: the low nibbles of A
  (s 0) and B (s 1), their high nibbles (s 2, 3), each with bits 2s..2s+1 of H's bytes on top.
  The codes are unsigned (0..63); the -32 is one dp4a of 0x20202020 against x, once a group.
  Scale group (h, s, w // 4): sc[8h + 2s + w // 4] * d.
- Q5_K (176 bytes / 256; 4-byte aligned, so words are loads of their own): qs word
  Q = qs[32j + 4w] holds columns 64j + 4w.. in its low nibbles (group 2j) and 64j + 32 + 4w..
  in its high ones (group 2j + 1), their 5th bits bits 2j and 2j + 1 of qh word qh[4w]. A group
  is one chunk of x: sum(w x) = d sc sx dot - dmin mn (sx sum(x_q)), the latter from x's floats.
- NVFP4 (codes [N, Kp / 2], a word is 8 columns): each 16-bit half of a code word holds four
  E2M1 codes as the four nibbles `prmt` takes as a selector, so two byte permutes of a table of
  the doubled values (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and a third by the signs
  turn it into a word of int8; the block scale carries the 1/2.
The portable forms (ASM off: the interpreter) compute the same integers with shifts.
"""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.fp8_quant import absmax_scales
    from skyline.ops.gemv import split_k_epilogue
    from skyline.ops.gemv_int_a8_triton import round_half_away
    from skyline.ops.pdl import pdl_wait

    @triton.jit
    def dp4a(w, x, acc, ASM: tl.constexpr):
        # acc + the four unsigned bytes of w times the four signed bytes of x, in int32
        if ASM:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [w, x, acc], dtype=tl.int32, is_pure=True, pack=1)
        else:
            for b in tl.static_range(4):
                acc += ((w >> (8 * b)) & 0xFF) * ((x << (24 - 8 * b)) >> 24)
            return acc

    # One word of eight NVFP4 codes against two words of x (its columns 0-3, 4-7): the doubled
    # E2M1 values of each half by two byte permutes (magnitudes 0-3 | 4-7 and their negatives),
    # a third picks the negative where the code's sign bit is set.
    _NVFP4_DOT = tl.constexpr("""
    {
    .reg .b32 tp0, tp1, tn0, tn1, m, s, pos, neg, v, h;
    mov.b32 tp0, 0x03020100;
    mov.b32 tp1, 0x0C080604;
    mov.b32 tn0, 0xFDFEFF00;
    mov.b32 tn1, 0xF4F8FAFC;
    and.b32 m, $1, 0x7777;
    prmt.b32 pos, tp0, tp1, m;
    prmt.b32 neg, tn0, tn1, m;
    shr.b32 s, $1, 1;
    and.b32 s, s, 0x4444;
    or.b32 s, s, 0x3210;
    prmt.b32 v, pos, neg, s;
    dp4a.s32.s32 $0, v, $2, 0;
    shr.b32 h, $1, 16;
    and.b32 m, h, 0x7777;
    prmt.b32 pos, tp0, tp1, m;
    prmt.b32 neg, tn0, tn1, m;
    shr.b32 s, h, 1;
    and.b32 s, s, 0x4444;
    or.b32 s, s, 0x3210;
    prmt.b32 v, pos, neg, s;
    dp4a.s32.s32 $0, v, $3, $0;
    }
    """)

    @triton.jit
    def _e2m1_doubled(c):
        # an E2M1 code (0..15) -> 2 x its value, int32
        mag = c & 7
        v = tl.where(mag < 4, mag, (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0))
        return tl.where(c >= 8, -v, v)

    @triton.jit
    def _nvfp4_dot(w, x0, x1, ASM: tl.constexpr):
        if ASM:
            return tl.inline_asm_elementwise(_NVFP4_DOT, "=r,r,r,r", [w, x0, x1],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            acc = tl.zeros_like(w + x0)
            for i in tl.static_range(8):
                xb = (x0 << (24 - 8 * i)) >> 24 if i < 4 else (x1 << (56 - 8 * i)) >> 24
                acc += _e2m1_doubled((w >> (4 * i)) & 0xF) * xb
            return acc

    @triton.jit
    def quantize_x_q8_kernel(x_ptr, xq_ptr, xf_ptr, M, K, KC, stride_xm, XQ: tl.constexpr,
                             INT8_MAX: tl.constexpr, PDL: tl.constexpr):
        # Program (m, block): chunks [block * XQ, +XQ) of 32 columns of row m of x -> xq
        # [M, 8 KC] int32 words (columns 4i..4i+3, one byte each), xf [M, KC, 2] (the chunk's
        # scale, the scale times its sum of codes); columns past K are 0
        pdl_wait(PDL)
        m = tl.program_id(0)
        chunks = tl.program_id(1) * XQ + tl.arange(0, XQ)
        cols = (chunks[:, None, None] * 32 + tl.arange(0, 8)[None, :, None] * 4
                + tl.arange(0, 4)[None, None, :])  # [XQ, 8, 4]
        xv = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(xv), axis=2), axis=1)
        sx, inv = absmax_scales(amax, INT8_MAX)
        q = round_half_away(xv * inv[:, None, None])
        words = tl.sum((q & 0xFF) << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # [XQ, 8]
        ok = chunks < KC
        tl.store(xq_ptr + (m * KC + chunks[:, None]) * 8 + tl.arange(0, 8)[None, :], words,
                 mask=ok[:, None])
        v = tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32) * sx
        tl.store(xf_ptr + (m * KC + chunks) * 2, sx, mask=ok)
        tl.store(xf_ptr + (m * KC + chunks) * 2 + 1, v, mask=ok)

    @triton.jit
    def _word16(w16_ptr, at, ok):
        # the int32 word of the 2-byte aligned bytes at int16 index `at`
        lo = tl.load(w16_ptr + at, mask=ok, other=0).to(tl.int32) & 0xFFFF
        hi = tl.load(w16_ptr + at + 1, mask=ok, other=0).to(tl.int32)
        return lo | (hi << 16)

    @triton.jit
    def _q6_k_a8(xq_ptr, xf_ptr, w8_ptr, w16_ptr, rows, ok, offs_m, m_ok, blk, KC, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
        # one super-block of each of [BLOCK_N] rows -> [BLOCK_N, BLOCK_M, 4] float32 partials
        base = rows * stride_w + blk * 210  # [BN] bytes, even
        h = tl.arange(0, 2)[:, None, None]
        t = tl.arange(0, 2)[None, :, None]
        u = tl.arange(0, 4)[None, None, :]
        w = t * 4 + u  # [1, 2, 4]: word lane, columns 4w.. of each 32
        b16 = (base // 2)[:, None, None, None]
        ok4 = ok[:, None, None, None]
        a_w = _word16(w16_ptr, b16 + (h * 32 + w * 2)[None], ok4)  # [BN, 2, 2, 4]
        b_w = _word16(w16_ptr, b16 + (h * 32 + 16 + w * 2)[None], ok4)
        h_w = _word16(w16_ptr, b16 + (64 + h * 16 + w * 2)[None], ok4)
        d = tl.load(w16_ptr + base // 2 + 104, mask=ok, other=0).to(tl.float16, bitcast=True)
        sc_at = w8_ptr + base[:, None, None] + 192 + (tl.arange(0, 2)[:, None] * 8
                                                      + tl.arange(0, 2)[None, :])[None]
        chunk = blk * 8 + tl.arange(0, 2) * 4  # [2]: the chunk of (h, s 0)
        x_at = (xq_ptr + (offs_m[:, None, None, None] * KC + chunk[None, :, None, None]) * 8
                + w[None])  # [BM, 2, 2, 4]
        f_at = xf_ptr + (offs_m[:, None] * KC + chunk[None, :]) * 2  # [BM, 2]
        m4 = m_ok[:, None, None, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M, 2, 2), dtype=tl.float32)
        for s in tl.static_range(4):
            src = a_w if s % 2 == 0 else b_w
            q = ((src >> (4 * (s // 2))) & 0x0F0F0F0F) | (((h_w >> (2 * s)) & 0x03030303) << 4)
            xw = tl.load(x_at + 8 * s, mask=m4, other=0)  # [BM, 2, 2, 4]
            dot = tl.sum(dp4a(q[:, None], xw[None], tl.zeros_like(xw)[None], ASM), axis=4)
            off = tl.sum(dp4a(tl.full(xw.shape, 0x20202020, tl.int32), xw, tl.zeros_like(xw),
                              ASM), axis=3)  # [BM, 2, 2]: 32 x sum(x_q) a group
            sx = tl.load(f_at + 2 * s, mask=m_ok[:, None], other=0.0)  # [BM, 2]
            sc = tl.load(sc_at + 2 * s, mask=ok[:, None, None], other=0).to(tl.int8,
                                                                              bitcast=True)
            dl = d.to(tl.float32)[:, None, None] * sc.to(tl.float32)  # [BN, 2, 2]
            acc += (dl[:, None] * sx[None, :, :, None]) * (dot - off[None]).to(tl.float32)
        return tl.reshape(acc, (BLOCK_N, BLOCK_M, 4))

    @triton.jit
    def _q5_k_a8(xq_ptr, xf_ptr, w8_ptr, w16_ptr, w32_ptr, rows, ok, offs_m, m_ok, blk, KC,
                 stride_w, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
        # one super-block of each of [BLOCK_N] rows -> [BLOCK_N, BLOCK_M, 4] float32 partials
        base = rows * stride_w + blk * 176  # [BN] bytes, a multiple of 4
        j = tl.arange(0, 4)
        w = tl.arange(0, 8)
        ok3 = ok[:, None, None]
        b32 = (base // 4)[:, None, None]
        qs = tl.load(w32_ptr + b32 + 12 + (j[:, None] * 8 + w[None, :])[None], mask=ok3,
                     other=0)  # [BN, 4, 8]
        qh = tl.load(w32_ptr + b32 + 4 + w[None, None, :], mask=ok3, other=0)  # [BN, 1, 8]
        sh = (2 * j)[None, :, None]
        q_lo = (qs & 0x0F0F0F0F) | (((qh >> sh) & 0x01010101) << 4)
        q_hi = ((qs >> 4) & 0x0F0F0F0F) | (((qh >> (sh + 1)) & 0x01010101) << 4)
        # 6-bit scale and min of group g (get_scale_min_k4), as gemv_block_triton's tiles
        g = tl.arange(0, 8)
        lo4 = (g < 4)[None, :]
        sb = w8_ptr + base[:, None] + 4
        a = tl.load(sb + tl.where(g < 4, g, g + 4)[None, :], mask=ok[:, None], other=0)
        mm = tl.load(sb + (g + 4)[None, :], mask=ok[:, None], other=0)
        hs = tl.load(sb + tl.maximum(g - 4, 0)[None, :], mask=ok[:, None], other=0)
        hm = tl.load(sb + g[None, :], mask=ok[:, None], other=0)
        sc = tl.where(lo4, a & 63, (a & 0x0F) | ((hs >> 2) & 0x30)).to(tl.float32)
        mn = tl.where(lo4, mm & 63, (mm >> 4) | ((hm >> 2) & 0x30)).to(tl.float32)
        d = tl.load(w16_ptr + base // 2, mask=ok, other=0).to(tl.float16, bitcast=True)
        dmin = tl.load(w16_ptr + base // 2 + 1, mask=ok, other=0).to(tl.float16, bitcast=True)
        sc_lo, sc_hi = tl.split(tl.reshape(d.to(tl.float32)[:, None] * sc, (BLOCK_N, 4, 2)))
        mn_lo, mn_hi = tl.split(tl.reshape(dmin.to(tl.float32)[:, None] * mn,
                                           (BLOCK_N, 4, 2)))
        chunk = blk * 8 + 2 * j  # [4]: the chunk of group 2j
        m3 = m_ok[:, None, None]
        x_at = xq_ptr + (offs_m[:, None, None] * KC + chunk[None, :, None]) * 8 + w[None, None]
        x_lo = tl.load(x_at, mask=m3, other=0)  # [BM, 4, 8]
        x_hi = tl.load(x_at + 8, mask=m3, other=0)
        f_at = xf_ptr + (offs_m[:, None] * KC + chunk[None, :]) * 2  # [BM, 4]
        f_ok = m_ok[:, None]
        sx_lo = tl.load(f_at, mask=f_ok, other=0.0)
        v_lo = tl.load(f_at + 1, mask=f_ok, other=0.0)
        sx_hi = tl.load(f_at + 2, mask=f_ok, other=0.0)
        v_hi = tl.load(f_at + 3, mask=f_ok, other=0.0)
        zero = tl.zeros((BLOCK_N, BLOCK_M, 4, 8), dtype=tl.int32)
        d_lo = tl.sum(dp4a(q_lo[:, None], x_lo[None], zero, ASM), axis=3).to(tl.float32)
        d_hi = tl.sum(dp4a(q_hi[:, None], x_hi[None], zero, ASM), axis=3).to(tl.float32)
        return (sc_lo[:, None] * sx_lo[None] * d_lo - mn_lo[:, None] * v_lo[None]
                + sc_hi[:, None] * sx_hi[None] * d_hi - mn_hi[:, None] * v_hi[None])

    @triton.jit
    def _nvfp4_a8(xq_ptr, xf_ptr, w32_ptr, s_ptr, rows, n_ok, offs_m, m_ok, k0, KP, KC,
                  stride_w32, stride_sn, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, ASM: tl.constexpr):
        # columns [k0, k0 + BLOCK_K) of [BLOCK_N] rows -> [BLOCK_N, BLOCK_M, BLOCK_K / 16]
        # float32 partials; columns at or past Kp (the stored width) load nothing
        G: tl.constexpr = BLOCK_K // 16
        g = tl.arange(0, G)
        e = tl.arange(0, 2)
        col = k0 + g[:, None] * 16 + e[None, :] * 8  # [G, 2]: first column of each word
        w_ok = n_ok[:, None, None] & (col < KP)[None]
        wv = tl.load(w32_ptr + rows[:, None, None] * stride_w32 + (col // 8)[None], mask=w_ok,
                     other=0)  # [BN, G, 2]
        s_ok = n_ok[:, None] & ((k0 + g * 16) < KP)[None, :]
        sc = tl.load(s_ptr + rows[:, None] * stride_sn + (k0 // 16 + g)[None, :], mask=s_ok,
                     other=0.0).to(tl.float32) * 0.5  # [BN, G]
        x_ok = m_ok[:, None, None] & (col < KC * 32)[None]
        x_at = xq_ptr + offs_m[:, None, None] * KC * 8 + (col // 4)[None]  # [BM, G, 2]
        x0 = tl.load(x_at, mask=x_ok, other=0)
        x1 = tl.load(x_at + 1, mask=x_ok, other=0)
        dot = tl.sum(_nvfp4_dot(wv[:, None], x0[None], x1[None], ASM), axis=3)  # [BN, BM, G]
        chunk = (k0 // 32 + g // 2)[None, :]
        sx = tl.load(xf_ptr + (offs_m[:, None] * KC + chunk) * 2,
                     mask=m_ok[:, None] & (chunk < KC), other=0.0)  # [BM, G]
        return sc[:, None] * sx[None] * dot.to(tl.float32)

    @triton.jit
    def gemv_block_a8_kernel(
        xq_ptr, xf_ptr, w8_ptr, w16_ptr, w32_ptr, s_ptr, ts_ptr, b_ptr, y_ptr, part_ptr,
        count_ptr, M, N, KP, KC, k_iters, num_splits, stride_w, stride_sn,
        FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr, ASM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the K tiles
        # [pid_k * k_iters, +k_iters) (GGUF: a tile is whole super-blocks; KP is then K). stride_w
        # is the bytes of a stored row. Each tile adds [BLOCK_N, BLOCK_M, G] float32 partials
        # (G: the scale groups a thread keeps apart), summed once at the end.
        G: tl.constexpr = BLOCK_K // 16 if FORMAT == 0 else 4
        pdl_wait(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        rows = offs_n.to(tl.int64)
        t_start = pid_k * k_iters
        acc = tl.zeros((BLOCK_N, BLOCK_M, G), dtype=tl.float32)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            if FORMAT == 0:
                acc += _nvfp4_a8(xq_ptr, xf_ptr, w32_ptr, s_ptr, rows, n_mask, offs_m, m_mask,
                                 (t_start + it) * BLOCK_K, KP, KC, stride_w // 4, stride_sn,
                                 BLOCK_N, BLOCK_M, BLOCK_K, ASM)
            else:
                # BLOCK_K / 256 super-blocks, unrolled in one basic block, so that the loads of
                # all of them can be in flight at once; past the last one a tile reads nothing
                for sb in tl.static_range(BLOCK_K // 256):
                    t = (t_start + it) * (BLOCK_K // 256) + sb
                    ok = n_mask & ((offs_n * 0 + t) < KC // 8)
                    mk = m_mask & ((offs_m * 0 + t) < KC // 8)
                    if FORMAT == 1:
                        acc += _q6_k_a8(xq_ptr, xf_ptr, w8_ptr, w16_ptr, rows, ok, offs_m, mk,
                                        t, KC, stride_w, BLOCK_N, BLOCK_M, ASM)
                    else:
                        acc += _q5_k_a8(xq_ptr, xf_ptr, w8_ptr, w16_ptr, w32_ptr, rows, ok,
                                        offs_m, mk, t, KC, stride_w, BLOCK_N, BLOCK_M, ASM)
        out = tl.sum(acc, axis=2)
        if FORMAT == 0:  # NVFP4's tensor scale, one per row
            out = out * tl.load(ts_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)
