"""Triton kernels of the quantized small-batch GEMV (ops/gemv_quant.py holds the references,
configurations and launcher): `gemv_int_fma_kernel` for INT8 / INT4 weights in FMA mode (int32
words, floats by exponent magic), `gemv_quant_kernel` for FP8 and for tensor-core (DOT) mode.
Both end in gemv.py's split-K epilogue."""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.fp8_quant import round_e4m3
    from skyline.ops.gemv import split_k_epilogue
    from skyline.ops.pdl import pdl_wait

    @triton.jit
    def _dot_t(w, x, acc, IEEE: tl.constexpr):
        # acc [BN, BM] += w [BN, BK] @ x[BM, BK]^T (or, operands swapped, [BM, BN])
        if IEEE:
            return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        return tl.dot(w, tl.trans(x), acc)

    # INT4 codes to exact floats OFFSET + q for the tensor cores (DOT mode), two nibbles of a
    # byte at a time: PTX over 4 bytes (one 32-bit register) per call. Each byte is moved to
    # the low byte of a 16-bit half (prmt), its nibble masked and OR-ed under the exponent of
    # OFFSET in one lop3 ((a & b) | c, LUT 0xEA): 16-bit float OFFSET + q, two per register,
    # about one instruction per weight and no int->float conversion. OFFSET is 128 for bf16
    # (0x4300: the mantissa's last bit weighs 1) and 1024 for fp16 (0x6400).
    def _int4_asm(magic: str) -> tl.constexpr:
        return tl.constexpr(f"""
        {{
        .reg .b32 t0, t1, u0, u1;
        prmt.b32 t0, $4, 0, 0x4140;
        prmt.b32 t1, $4, 0, 0x4342;
        shr.b32 u0, t0, 4;
        shr.b32 u1, t1, 4;
        lop3.b32 $0, t0, 0x000F000F, {magic}, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, {magic}, 0xEA;
        lop3.b32 $2, u0, 0x000F000F, {magic}, 0xEA;
        lop3.b32 $3, u1, 0x000F000F, {magic}, 0xEA;
        }}
        """)

    _INT4_ASM_BF16 = _int4_asm("0x43004300")
    _INT4_ASM_FP16 = _int4_asm("0x64006400")

    @triton.jit
    def _int4_offset_floats(wq, dtype: tl.constexpr, ASM: tl.constexpr, OFFSET: tl.constexpr):
        # uint8 [.., n] -> (low nibbles, high nibbles) as dtype [.., n], each OFFSET + code.
        if ASM == 1:
            return tl.inline_asm_elementwise(
                _INT4_ASM_BF16, "=r,=r,=r,=r,r", [wq],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif ASM == 2:
            return tl.inline_asm_elementwise(
                _INT4_ASM_FP16, "=r,=r,=r,=r,r", [wq],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:  # portable: the same values through float conversions
            lo = ((wq & 0x0F).to(tl.float32) + OFFSET).to(dtype)
            hi = ((wq >> 4).to(tl.float32) + OFFSET).to(dtype)
            return lo, hi

    @triton.jit
    def gemv_int_fma_kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, k_iters, num_splits, stride_xm, stride_wn, stride_sn,
        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr,
        X_BCAST: tl.constexpr, PDL: tl.constexpr,
    ):
        # INT8 / INT4 weights in FMA mode, read as int32 words (PER = 4 bytes or 8 nibbles;
        # element 8j + i of a row is nibble i of word j, bits 4i..4i+3, little-endian) against
        # contiguous columns of x. Tiles are [BLOCK_N, BLOCK_M, BLOCK_K / PER, PER].
        # Code to float without an int->float convert: shifting code i to bits LO..LO+BITS-1 and
        # OR-ing in the bits of MAGIC = 2^(23 - LO) gives the float MAGIC + q exactly; then
        # w = (MAGIC + q) * s - (MAGIC + zero) * s is one FMA with a per-row constant per tile.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        PER: tl.constexpr = 32 // BITS
        BW: tl.constexpr = BLOCK_K // PER
        LO: tl.constexpr = 23 - BITS  # code bits LO..22, under the exponent of MAGIC
        MAGIC: tl.constexpr = 1 << BITS  # 2^(23 - LO): the weight of bit LO is 1
        MAGIC_BITS: tl.constexpr = (127 + BITS) << 23
        CODE_MASK: tl.constexpr = ((1 << BITS) - 1) << LO
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_w = tl.arange(0, BW)
        offs_i = tl.arange(0, PER)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_start = pid_k * k_iters * BLOCK_K
        pdl_wait(PDL)
        n4 = offs_n[:, None, None, None]
        zero4 = tl.zeros((BLOCK_N, BLOCK_M, BW, PER), dtype=tl.int32)
        w_ptrs = (w_ptr + n4.to(tl.int64) * stride_wn
                  + (k_start // PER + offs_w)[None, None, :, None])
        kk = (offs_w[:, None] * PER + offs_i[None, :])[None, None, :, :]  # column in the tile
        # x spread over the tile, as in gemv.py's FMA mode, or (X_BCAST) one [BLOCK_M, BLOCK_K]
        # load broadcast over the rows of W: a layout conversion per tile, but each x value
        # is loaded and converted once per thread instead of once per weight (better from two
        # rows of x on; the tuner picks).
        x_ptrs = x_ptr + offs_m[None, :, None, None] * stride_xm + k_start + kk
        if not X_BCAST:
            x_ptrs = x_ptrs + zero4
        sz_offs = n4 * stride_sn  # [BLOCK_N, 1, 1, 1]
        shl = tl.maximum(LO - offs_i * BITS, 0)[None, None, None, :]
        shr = tl.maximum(offs_i * BITS - LO, 0)[None, None, None, :]
        n_ok = n4 < N
        m_ok = offs_m[None, :, None, None] < M
        acc = tl.zeros((BLOCK_N, BLOCK_M, BW, PER), dtype=tl.float32)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            k0 = k_start + it * BLOCK_K
            w_mask = n_ok
            x_mask = m_ok
            if not EVEN_K:
                # Weights are padded to Kp, a multiple of GROUP: a tile starting before K lies
                # in one group inside Kp (its columns past K meet zero x); a tile starting at or
                # past K may lie past Kp (K not a multiple of SPLIT_K * BLOCK_K), so it loads
                # no weight, scale or zero (scale 0: a NaN read would poison the sum).
                w_mask = w_mask & ((n4 * 0 + k0) < K)
                x_mask = x_mask & ((k0 + kk) < K)
            g = k0 // GROUP  # BLOCK_K divides GROUP: the tile lies in one group
            s = tl.load(s_ptr + sz_offs + g, mask=w_mask, other=0.0)
            z = tl.load(z_ptr + sz_offs + g, mask=w_mask, other=0).to(tl.float32)
            c = -(z + MAGIC) * s
            word = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint32, bitcast=True)
            code = ((word << shl) >> shr) & CODE_MASK
            wv = (code | MAGIC_BITS).to(tl.float32, bitcast=True) * s + c
            xv = tl.load(x_ptrs, mask=x_mask, other=0.0)
            acc += wv * xv.to(tl.float32)
            w_ptrs += BW
            x_ptrs += BLOCK_K
        out = tl.sum(tl.sum(acc, axis=3), axis=2)
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)

    @triton.jit
    def gemv_quant_kernel(
        x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, xs_ptr,
        M, N, K, k_iters, num_splits, stride_xm, stride_wn, stride_sn,
        WEIGHT_KIND: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr, X_QUANT: tl.constexpr = 0,
        XS_BLOCK: tl.constexpr = 0, XS_STRIDE: tl.constexpr = 1,
        ROUND_E4M3: tl.constexpr = False, INT4_ASM: tl.constexpr = 0,
        INT4_OFFSET: tl.constexpr = 128.0, X_LEFT: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the K tiles
        # [pid_k * k_iters, +k_iters), as in gemv.py. INT4 tiles are [BLOCK_N, BLOCK_K / 2]
        # bytes against the even (low nibbles) and odd (high nibbles) columns of x.
        # X_QUANT (FP8 weights, DOT mode; the tensor cores multiply two fp8 tiles, nothing is
        # converted per weight): 1, x is e4m3 with a float32 scale per row (xs_ptr), or with
        # XS_BLOCK one per row and XS_BLOCK columns (a multiple of BLOCK_K; XS_STRIDE scales
        # a row), applied tile by tile; 2, x is bf16/fp16 and each [BLOCK_M, BLOCK_K] tile is
        # quantized here, one scale per row and tile (amax / 448), its product scaled back
        # before it joins the sum.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        PACK: tl.constexpr = 2 if WEIGHT_KIND == 2 else 1
        BKW: tl.constexpr = BLOCK_K // PACK  # weight bytes per row and tile
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_b = tl.arange(0, BKW)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_start = pid_k * k_iters * BLOCK_K
        pdl_wait(PDL)
        w_ptrs = (w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
                  + (k_start // PACK + offs_b)[None, :])
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_b * PACK)[None, :]
        if X_LEFT:  # INT4 DOT: x the left operand, the accumulator [BLOCK_M, BLOCK_N]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        elif USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M, BKW), dtype=tl.float32)
            w_ptrs = w_ptrs[:, None, :]
            # x spread over the whole tile, as in gemv.py (no layout conversion of the W tile).
            x_ptrs = x_ptrs[None, :, :] + tl.zeros((BLOCK_N, BLOCK_M, BKW), dtype=tl.int32)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            k0 = k_start + it * BLOCK_K
            x_mask = m_mask[:, None]
            # Integer weights are padded to Kp, a multiple of GROUP: a tile that starts before K
            # lies inside one group, so inside Kp, and its columns past K (zero x) may be read.
            # A tile that starts at or past K can lie past Kp (the last splits of a K that is
            # not a multiple of SPLIT_K * BLOCK_K; K = 200 with group 32 and 3 splits covers
            # 288 > Kp = 224): its group index is out of range, and its scale and weight loads
            # would read the next row's or past the end of the buffers, where a NaN or Inf
            # scale times zero x is NaN. Such tiles load nothing (scale 0, weight 0).
            w_mask = n_mask[:, None]
            sz_mask = n_mask
            if not EVEN_K:
                kk = k0 + offs_b * PACK
                x_mask = x_mask & (kk < K)[None, :]
                if WEIGHT_KIND == 0:
                    w_mask = w_mask & (kk < K)[None, :]
                else:
                    k_ok = (offs_n * 0 + k0) < K  # [BLOCK_N] booleans, not a scalar
                    w_mask = w_mask & k_ok[:, None]
                    sz_mask = sz_mask & k_ok
                if WEIGHT_KIND == 2:
                    x_mask_hi = m_mask[:, None] & (kk + 1 < K)[None, :]
            else:
                if WEIGHT_KIND == 2:
                    x_mask_hi = x_mask
            if not USE_DOT:
                w_mask = w_mask[:, None, :]
                x_mask = x_mask[None, :, :]
                if WEIGHT_KIND == 2:
                    x_mask_hi = x_mask_hi[None, :, :]
            if WEIGHT_KIND != 0:
                g = k0 // GROUP
                s = tl.load(s_ptr + offs_n * stride_sn + g, mask=sz_mask, other=0.0)
                z = tl.load(z_ptr + offs_n * stride_sn + g, mask=sz_mask, other=0).to(tl.float32)
            wq = tl.load(w_ptrs, mask=w_mask, other=0.0 if WEIGHT_KIND == 0 else 0)
            xv = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if WEIGHT_KIND == 2:
                xh = tl.load(x_ptrs + 1, mask=x_mask_hi, other=0.0)
            if USE_DOT:
                if WEIGHT_KIND == 0 and X_QUANT == 1 and XS_BLOCK > 0:
                    # a split's tiles may start past K (their x is masked to 0): no scale
                    sx = tl.load(xs_ptr + offs_m * XS_STRIDE + k0 // XS_BLOCK,
                                 mask=m_mask & ((offs_m * 0 + k0) < K), other=0.0)
                    t = tl.dot(wq, tl.trans(xv), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
                    acc += t * sx[None, :]
                elif WEIGHT_KIND == 0 and X_QUANT == 1:
                    acc = tl.dot(wq, tl.trans(xv), acc)
                elif WEIGHT_KIND == 0 and X_QUANT == 2:
                    xf = xv.to(tl.float32)
                    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30)  # [BLOCK_M]
                    sx = amax / 448.0
                    xs = xf * (448.0 / amax)[:, None]
                    if ROUND_E4M3:  # the interpreter: round first, so its conversion is exact
                        xs = round_e4m3(xs)
                    xq = xs.to(tl.float8e4nv)
                    t = tl.dot(wq, tl.trans(xq), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
                    acc += t * sx[None, :]
                elif WEIGHT_KIND == 1:
                    # codes 0..255 are exact in bf16/fp16; the zero (an integer, or any float:
                    # GGUF offsets) leaves the sum as zero * sum(x over the tile)
                    t = _dot_t(wq.to(xv.dtype), xv, tl.zeros((BLOCK_N, BLOCK_M),
                                                             dtype=tl.float32), IEEE)
                    xsum = tl.sum(xv.to(tl.float32), axis=1)  # [BLOCK_M]
                    acc += (t - z[:, None] * xsum[None, :]) * s[:, None]
                else:
                    # The MMA takes OFFSET + q as unpacked; the zero point and OFFSET leave
                    # the tile's sum afterwards as (OFFSET + zero) * sum(x over the tile).
                    lo, hi = _int4_offset_floats(wq, xv.dtype, INT4_ASM, INT4_OFFSET)
                    xsum = tl.sum(xv.to(tl.float32) + xh.to(tl.float32), axis=1)  # [BLOCK_M]
                    if X_LEFT:
                        t = _dot_t(xv, lo, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE)
                        t = _dot_t(xh, hi, t, IEEE)
                        acc += (t - xsum[:, None] * (z[None, :] + INT4_OFFSET)) * s[None, :]
                    else:
                        t = _dot_t(lo, xv, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), IEEE)
                        t = _dot_t(hi, xh, t, IEEE)
                        acc += (t - (z[:, None] + INT4_OFFSET) * xsum[None, :]) * s[:, None]
            else:
                if WEIGHT_KIND == 1:
                    wd = (wq.to(tl.float32) - z[:, None, None]) * s[:, None, None]
                    acc += wd * xv.to(tl.float32)
                else:
                    lo = ((wq & 0x0F).to(tl.float32) - z[:, None, None]) * s[:, None, None]
                    hi = ((wq >> 4).to(tl.float32) - z[:, None, None]) * s[:, None, None]
                    acc += lo * xv.to(tl.float32) + hi * xh.to(tl.float32)
            w_ptrs += BKW
            x_ptrs += BLOCK_K
        if X_LEFT:
            out = tl.trans(acc)
        elif USE_DOT:
            out = acc
        else:
            out = tl.sum(acc, axis=2)
        if WEIGHT_KIND == 0:  # per-output-row scale, once
            out = out * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if X_QUANT == 1 and XS_BLOCK == 0:  # per-row scale of x
            out = out * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)
