"""Triton kernels of the block-scaled GEMV's integer mode (ops/gemv_block.py holds the references,
configurations and launchers): NVFP4 (FORMAT 0), GGUF Q6_K (1), Q5_K (2) and MXFP4 (3) against x
rounded to int8 per 32 columns, by `dp4a`, as llama.cpp's quantized GEMVs take q8_1 activations.

x comes as int32 words of four consecutive int8 columns [M, 8 KC] and per chunk of 32 columns
its scale and scale * sum of codes [M, KC, 2] (quantize_x_q8_kernel). A weight word (four codes,
one byte each, in column order) meets the word of x over the same columns in one `dp4a`, exact
in int32; times its group's scale and x's chunk scale it joins a float32 accumulator that keeps
every word lane of the tile apart, summed once after the K loop. Every operand of a tile is
loaded at the accumulator's shape (x, and values a lane repeats, broadcast by their addresses:
L1 serves the repeats), so the loop needs no reduction across threads and, where the loads share
a vector width, no change of layout. Per format, what a lane turns into words:
- Q6_K (210 bytes / 256; 2-byte aligned, so words are two 16-bit loads): for half h and word
  lane w (columns 4w..4w+3 of each 32), ql words A = ql[64h + 4w] and B = ql[64h + 32 + 4w] and
  qh word H = qh[32h + 4w] give the four words of columns 128h + 32s + 4w: the low nibbles of A
  (s 0) and B (s 1), their high nibbles (s 2, 3), each with bits 2s..2s+1 of H's bytes on top.
  The codes are unsigned (0..63); the -32 is a dp4a of 0x20202020 against x. Scale group
  (h, s, w // 4): sc[8h + 2s + w // 4] * d.
- Q5_K (176 bytes / 256; 4-byte aligned, so 16-byte vector loads): qs word Q = qs[32j + 4w]
  holds columns 64j + 4w.. in its low nibbles (group 2j) and 64j + 32 + 4w.. in its high ones
  (group 2j + 1), their 5th bits bits 2j and 2j + 1 of qh word qh[4w]. A group is one chunk of
  x: sum(w x) = d sc sx dot - dmin mn (sx sum(x_q)), the latter from x's floats, an eighth in
  each of the group's 8 lanes. d, dmin and the 6-bit scales and mins are the block's first four
  words.
- NVFP4 and MXFP4 (codes [N, Kp / 2], a word is 8 columns, met by the int64 of x over them):
  each 16-bit half of a code word holds four E2M1 codes as the four nibbles `prmt` takes as a
  selector, so two byte permutes of a table of the doubled values (0, 1, 2, 3, 4, 6, 8, 12 and
  their negatives) and a third by the signs turn it into a word of int8; the block scale (E4M3
  per 16, E8M0 per 32) carries the 1/2. A lane takes a whole scale group (NVFP4 2 words, MXFP4
  4) at once: one vector load of its codes and of x, one piece of PTX for its dot product,
  then one conversion to float and one multiply-add by the scales for the group (a word at a
  time took 1.2x (NVFP4) and 1.5x (MXFP4) the instructions a weight in the loop:
  bench/kernels/gemv_block_ptx_count.py).
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

    def _fp4_dot_asm(words: int) -> str:
        # `words` words of eight E2M1 codes ($1..) against the int64s of x over the same
        # columns ($words+1..) -> their dot product $0, int32. Per word: the doubled magnitudes
        # (0, 1, 2, 3, 4, 6, 8, 12) of its codes' low three bits and their negatives, each
        # 16-bit half by two byte permutes of tables, a third takes the negative where the
        # code's sign bit is set; the selectors of both halves are made once a word (a permute
        # reads the low 16 bits of its selector).
        lines = ["{", ".reg .b32 tp0, tp1, tn0, tn1, m, s, pos, neg, v, xl, xh;",
                 "mov.b32 tp0, 0x03020100;", "mov.b32 tp1, 0x0C080604;",
                 "mov.b32 tn0, 0xFDFEFF00;", "mov.b32 tn1, 0xF4F8FAFC;"]
        for i in range(words):
            lines += [f"mov.b64 {{xl, xh}}, ${words + 1 + i};",
                      f"and.b32 m, ${1 + i}, 0x77777777;",
                      f"shr.b32 s, ${1 + i}, 1;",
                      "and.b32 s, s, 0x44444444;",
                      "or.b32 s, s, 0x32103210;"]
            for half, x in enumerate(("xl", "xh")):
                if half:
                    lines += ["shr.b32 m, m, 16;", "shr.b32 s, s, 16;"]
                acc = "0" if i == 0 and half == 0 else "$0"
                lines += ["prmt.b32 pos, tp0, tp1, m;", "prmt.b32 neg, tn0, tn1, m;",
                          "prmt.b32 v, pos, neg, s;", f"dp4a.s32.s32 $0, v, {x}, {acc};"]
        return "\n".join(lines + ["}"])

    _FP4_DOT_2 = tl.constexpr(_fp4_dot_asm(2))  # NVFP4: a scale group of 16 columns
    _FP4_DOT_4 = tl.constexpr(_fp4_dot_asm(4))  # MXFP4: 32 columns

    @triton.jit
    def _e2m1_doubled(c):
        # an E2M1 code (0..15) -> 2 x its value, int32
        mag = c & 7
        v = tl.where(mag < 4, mag, (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0))
        return tl.where(c >= 8, -v, v)

    @triton.jit
    def _e2m1_word_dot(w, x):
        # w int32 (eight codes), x int64 (eight int8 columns) -> their dot product, int32
        acc = tl.zeros_like(w)
        for i in tl.static_range(8):
            xb = ((x << (56 - 8 * i)) >> 56).to(tl.int32)
            acc += _e2m1_doubled((w >> (4 * i)) & 0xF) * xb
        return acc

    @triton.jit
    def _split4(t):
        # t [A, B, C, 4] -> its four [A, B, C] slices (in the order 0, 2, 1, 3)
        a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2], 2, 2)))
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        return a0, a1, b0, b1

    @triton.jit
    def _e2m1_group_dot(w, x, MX: tl.constexpr, ASM: tl.constexpr):
        # w int32 [..., W] (W words of codes: 4 with MX, else 2), x int64 [..., W] (x over the
        # same columns) -> their dot product [...], int32
        if MX:
            w0, w1, w2, w3 = _split4(w)
            x0, x1, x2, x3 = _split4(x)
            if ASM:
                dot = tl.inline_asm_elementwise(_FP4_DOT_4, "=r,r,r,r,r,l,l,l,l",
                                                [w0, w1, w2, w3, x0, x1, x2, x3],
                                                dtype=tl.int32, is_pure=True, pack=1)
            else:
                dot = (_e2m1_word_dot(w0, x0) + _e2m1_word_dot(w1, x1)
                       + _e2m1_word_dot(w2, x2) + _e2m1_word_dot(w3, x3))
        else:
            w0, w1 = tl.split(w)
            x0, x1 = tl.split(x)
            if ASM:
                dot = tl.inline_asm_elementwise(_FP4_DOT_2, "=r,r,r,l,l", [w0, w1, x0, x1],
                                                dtype=tl.int32, is_pure=True, pack=1)
            else:
                dot = _e2m1_word_dot(w0, x0) + _e2m1_word_dot(w1, x1)
        return dot

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
    def _load(ptr, ok, EVEN: tl.constexpr):
        # ptr's values; unless EVEN, 0 where ok is false
        if EVEN:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=ok, other=0.0)

    @triton.jit
    def _word16(w16_ptr, at, ok, EVEN: tl.constexpr):
        # the int32 word of the 2-byte aligned bytes at int16 index `at`
        lo = _load(w16_ptr + at, ok, EVEN).to(tl.int32) & 0xFFFF
        hi = _load(w16_ptr + at + 1, ok, EVEN).to(tl.int32)
        return lo | (hi << 16)

    @triton.jit
    def _q6_k_a8(xq_ptr, xf_ptr, w8_ptr, w16_ptr, rows, ok, offs_m, blk, KC, stride_w, acc,
                 ASM: tl.constexpr, EVEN: tl.constexpr):
        # acc [2, BLOCK_N, BLOCK_M, 8] float32 (half, row, row of x, word lane) plus one
        # super-block of each row; every load at acc's shape, as _q5_k_a8's. The 16-bit loads
        # of the weights take a layout of one element a thread, x's words one of two: each
        # code word moves to x's layout and its product back (shuffles within the warp), which
        # measured faster than loading x by halves too.
        base = rows * stride_w + blk * 210  # [BN] bytes, even
        h = tl.arange(0, 2)[:, None, None, None]
        w = tl.arange(0, 8)[None, None, None, :]
        b16 = (base // 2)[None, :, None, None]
        m4 = offs_m[None, None, :, None]
        zero = b16 * 0 + m4 * 0 + h * 0 + w * 0  # [2, BN, BM, 8]
        a_w = _word16(w16_ptr, zero + b16 + h * 32 + w * 2, ok, EVEN)
        b_w = _word16(w16_ptr, zero + b16 + h * 32 + 16 + w * 2, ok, EVEN)
        h_w = _word16(w16_ptr, zero + b16 + 64 + h * 16 + w * 2, ok, EVEN)
        d = _load(w16_ptr + b16 + 104, ok, EVEN).to(tl.float16, bitcast=True).to(tl.float32)
        sc_at = w8_ptr + base[None, :, None, None] + 192 + h * 8 + w // 4  # [2, BN, 1, 8]
        chunk = blk * 8 + h * 4  # the chunk of (h, s 0)
        x_at = xq_ptr + zero + (m4 * KC + chunk) * 8 + w
        f_at = xf_ptr + (m4 * KC + chunk) * 2  # [2, 1, BM, 1]
        for s in tl.static_range(4):
            src = a_w if s % 2 == 0 else b_w
            q = ((src >> (4 * (s // 2))) & 0x0F0F0F0F) | (((h_w >> (2 * s)) & 0x03030303) << 4)
            xw = _load(x_at + 8 * s, ok, EVEN)
            dot = dp4a(q, xw, zero, ASM) - dp4a(zero + 0x20202020, xw, zero, ASM)
            sx = _load(f_at + 2 * s, ok, EVEN)
            sc = _load(sc_at + 2 * s, ok, EVEN).to(tl.int8, bitcast=True).to(tl.float32)
            acc += (d * sc * sx) * dot.to(tl.float32)
        return acc

    @triton.jit
    def _q5_k_a8(xq_ptr, xf_ptr, w16_ptr, w32_ptr, rows, ok, offs_m, blk, KC, stride_w, acc,
                 ASM: tl.constexpr, EVEN: tl.constexpr):
        # acc [4, BLOCK_N, BLOCK_M, 8] float32 (qs row j, row, row of x, word lane) plus one
        # super-block of each row. Words of weights and x are loaded at acc's shape (x and qh
        # repeat along the axes they do not depend on: L1 serves the repeats), so they share
        # one layout; the per-group values are small enough to be loaded in it too.
        base = rows * stride_w + blk * 176  # [BN] bytes, a multiple of 4
        j = tl.arange(0, 4)[:, None, None, None]
        w = tl.arange(0, 8)[None, None, None, :]
        r4 = (base // 4)[None, :, None, None]
        m4 = offs_m[None, None, :, None]
        zero = r4 * 0 + m4 * 0 + j * 0 + w * 0  # [4, BN, BM, 8]
        qs = _load(w32_ptr + zero + r4 + 12 + j * 8 + w, ok, EVEN)
        qh = _load(w32_ptr + zero + r4 + 4 + w, ok, EVEN)
        q_lo = (qs & 0x0F0F0F0F) | (((qh >> (2 * j)) & 0x01010101) << 4)
        q_hi = ((qs >> 4) & 0x0F0F0F0F) | (((qh >> (2 * j + 1)) & 0x01010101) << 4)
        x_at = xq_ptr + zero + (m4 * KC + blk * 8 + 2 * j) * 8 + w  # chunk 2j of the block
        x_lo = _load(x_at, ok, EVEN)
        x_hi = _load(x_at + 8, ok, EVEN)
        d_lo = dp4a(q_lo, x_lo, zero, ASM).to(tl.float32)
        d_hi = dp4a(q_hi, x_hi, zero, ASM).to(tl.float32)
        # d, dmin and the 12 bytes of 6-bit scales and mins as four words; groups 2j, 2j + 1
        # (get_scale_min_k4): group g < 4 from bytes g (scale) and g + 4 (min), else the
        # nibbles of byte g + 4 with the top 2 bits of bytes g - 4 and g
        hd = w32_ptr + (base // 4)[None, :, None, None]  # [1, BN, 1, 1]
        w0 = _load(hd, ok, EVEN)
        w1 = _load(hd + 1, ok, EVEN)
        w2 = _load(hd + 2, ok, EVEN)
        w3 = _load(hd + 3, ok, EVEN)
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (w0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        lo4 = j < 2
        s0 = 16 * (j & 1)  # byte 2j mod 4 of its word
        a0, a1 = w1 >> s0, w1 >> (s0 + 8)
        b0, b1 = w2 >> s0, w2 >> (s0 + 8)
        c0, c1 = w3 >> s0, w3 >> (s0 + 8)
        sc0 = tl.where(lo4, a0 & 63, (c0 & 0x0F) | ((a0 >> 2) & 0x30)).to(tl.float32)
        sc1 = tl.where(lo4, a1 & 63, (c1 & 0x0F) | ((a1 >> 2) & 0x30)).to(tl.float32)
        mn0 = tl.where(lo4, b0 & 63, ((c0 >> 4) & 0x0F) | ((b0 >> 2) & 0x30)).to(tl.float32)
        mn1 = tl.where(lo4, b1 & 63, ((c1 >> 4) & 0x0F) | ((b1 >> 2) & 0x30)).to(tl.float32)
        f_at = xf_ptr + (m4 * KC + blk * 8 + 2 * j) * 2  # [4, 1, BM, 1]
        sx0 = _load(f_at, ok, EVEN)
        v0 = _load(f_at + 1, ok, EVEN)
        sx1 = _load(f_at + 2, ok, EVEN)
        v1 = _load(f_at + 3, ok, EVEN)
        # each of a group's 8 word lanes carries 1/8 of its offset (exact scaling)
        off = (dmin * 0.125) * (mn0 * v0 + mn1 * v1)
        return acc + (d * sc0 * sx0) * d_lo + (d * sc1 * sx1) * d_hi - off

    @triton.jit
    def _fp4_codes(w32_ptr, rows, offs_m, k0, KP, stride_w32, G: tl.constexpr,
                   MX: tl.constexpr, EVEN: tl.constexpr):
        # The code words of columns [k0, k0 + G * SG) of each row, [G, BLOCK_N, BLOCK_M, SG / 8]
        # (scale group, row, row of x, word): one vector load a group, in the layout of x's
        # words that _fp4_a8 meets them with. Columns at or past Kp (the stored width) read
        # nothing, unless EVEN (Kp a whole number of tiles).
        SG: tl.constexpr = 32 if MX else 16
        W: tl.constexpr = SG // 8
        g3 = tl.arange(0, G)[:, None, None]
        g = g3[:, :, :, None]
        e = tl.arange(0, W)[None, None, None, :]
        r4 = rows[None, :, None, None]
        m4 = offs_m[None, None, :, None]
        zero = r4 * 0 + m4 * 0 + g * 0 + e * 0
        g_ok = (k0 + g3 * SG) < KP  # [G, 1, 1]
        return _load(w32_ptr + zero + r4 * stride_w32 + k0 // 8 + g * W + e,
                     g_ok[:, :, :, None], EVEN)

    @triton.jit
    def _fp4_a8(xq64_ptr, xf_ptr, wv, s_ptr, rows, offs_m, k0, KP, KC, stride_sn, acc,
                MX: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr):
        # acc [BLOCK_K / SG, BLOCK_N, BLOCK_M] float32 (scale group, row, row of x) plus
        # columns [k0, k0 + BLOCK_K) of each row, a scale group of SG columns (NVFP4 16, MXFP4
        # 32) at a time: its W = SG / 8 code words wv (from _fp4_codes) against the int64s of
        # x over the same columns, loaded at [G, BN, BM, W] (so in one layout), their integer
        # dot product made in one piece of PTX, then times the group's scales. Columns at or
        # past Kp read nothing, unless EVEN (Kp a whole number of tiles, x as wide). The
        # group's scale: NVFP4's E4M3, or (MX) MXFP4's E8M0, 2^(e - 127) made from its bits
        # (e = 0 reads 0, not 2^-127), halved: the codes are doubled.
        G: tl.constexpr = acc.shape[0]
        SG: tl.constexpr = 32 if MX else 16
        W: tl.constexpr = SG // 8
        g3 = tl.arange(0, G)[:, None, None]
        g = g3[:, :, :, None]
        e = tl.arange(0, W)[None, None, None, :]
        r3 = rows[None, :, None]
        m3 = offs_m[None, None, :]
        m4 = m3[:, :, :, None]
        word = k0 // 8 + g * W + e  # the word of each 8 columns
        g_ok = (k0 + g3 * SG) < KP  # [G, 1, 1]
        # x's words at the codes' shape [G, BN, BM, W], so both are in one layout
        xv = _load(xq64_ptr + tl.zeros_like(wv) + m4 * (KC * 4) + word, word < KC * 4, EVEN)
        dot = _e2m1_group_dot(wv, xv, MX, ASM).to(tl.float32)  # [G, BN, BM]
        sg = k0 // SG + g3
        if MX:
            ex = _load(s_ptr + r3 * stride_sn + sg, g_ok, EVEN).to(tl.int32)
            sc = (ex << 23).to(tl.float32, bitcast=True) * 0.5  # [G, BN, 1]
        else:
            sc = _load(s_ptr + r3 * stride_sn + sg, g_ok, EVEN).to(tl.float32) * 0.5
        chunk = (k0 + g3 * SG) // 32
        sx = _load(xf_ptr + (m3 * KC + chunk) * 2, chunk < KC, EVEN)  # [G, 1, BM]
        return acc + (sc * sx) * dot

    @triton.jit
    def gemv_block_a8_kernel(
        xq_ptr, xf_ptr, w8_ptr, w16_ptr, w32_ptr, s_ptr, ts_ptr, b_ptr, y_ptr, part_ptr,
        count_ptr, M, N, KP, KC, k_iters, num_splits, stride_w, stride_sn,
        FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
        EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr,
        ASM: tl.constexpr, PDL: tl.constexpr,
    ):
        # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the K tiles
        # [pid_k * k_iters, +k_iters) (GGUF: a tile is whole super-blocks; KP is then K).
        # stride_w is the bytes of a stored row. Rows of W and x past N and M read the last
        # one (their results are not stored), so loads need no mask but for K: with EVEN_K
        # every split's tiles lie inside it. Each tile adds float32 partials at the tile
        # function's shape, summed once at the end. FP4: the first tile's codes are loaded
        # before the wait for the previous kernel (no kernel of a step writes weights), so
        # their latency overlaps its end; then the loop takes the tiles after it.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        offs_mc = tl.minimum(offs_m, M - 1)
        t_start = pid_k * k_iters
        FP4: tl.constexpr = FORMAT == 0 or FORMAT == 3
        G: tl.constexpr = BLOCK_K // (32 if FORMAT == 3 else 16)  # FP4's scale groups a tile
        if FP4:
            acc = tl.zeros((G, BLOCK_N, BLOCK_M), dtype=tl.float32)
            wv = _fp4_codes(w32_ptr, rows, offs_mc, t_start * BLOCK_K, KP, stride_w // 4, G,
                            FORMAT == 3, EVEN_K)
        elif FORMAT == 1:
            acc = tl.zeros((2, BLOCK_N, BLOCK_M, 8), dtype=tl.float32)
        else:
            acc = tl.zeros((4, BLOCK_N, BLOCK_M, 8), dtype=tl.float32)
        pdl_wait(PDL)
        if FP4:
            acc = _fp4_a8(xq_ptr, xf_ptr, wv, s_ptr, rows, offs_mc, t_start * BLOCK_K, KP, KC,
                          stride_sn, acc, FORMAT == 3, ASM, EVEN_K)
        for it in tl.range(1 if FP4 else 0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            if FP4:
                k0 = (t_start + it) * BLOCK_K
                wt = _fp4_codes(w32_ptr, rows, offs_mc, k0, KP, stride_w // 4, G, FORMAT == 3,
                                EVEN_K)
                acc = _fp4_a8(xq_ptr, xf_ptr, wt, s_ptr, rows, offs_mc, k0, KP, KC, stride_sn,
                              acc, FORMAT == 3, ASM, EVEN_K)
            else:
                # BLOCK_K / 256 super-blocks, unrolled in one basic block, so that the loads of
                # all of them can be in flight at once; past the last one a tile reads nothing
                for sb in tl.static_range(BLOCK_K // 256):
                    t = (t_start + it) * (BLOCK_K // 256) + sb
                    ok = t < KC // 8
                    if FORMAT == 1:
                        acc = _q6_k_a8(xq_ptr, xf_ptr, w8_ptr, w16_ptr, rows, ok, offs_mc, t,
                                       KC, stride_w, acc, ASM, EVEN_K)
                    else:
                        acc = _q5_k_a8(xq_ptr, xf_ptr, w16_ptr, w32_ptr, rows, ok, offs_mc, t,
                                       KC, stride_w, acc, ASM, EVEN_K)
        if FP4:
            out = tl.sum(acc, axis=0)
        else:
            out = tl.sum(tl.sum(acc, axis=3), axis=0)
        if FORMAT == 0:  # NVFP4's tensor scale, one per row
            out = out * tl.load(ts_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)
