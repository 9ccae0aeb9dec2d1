"""Triton kernel of the W4A8 GEMV (ops/gemv_int_a8.py holds the reference, configurations and
launcher): INT4 weight words against int8 activations by `dp4a`, ending in gemv.py's split-K
epilogue."""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.fp8_quant import absmax_scales
    from skyline.ops.gemv import split_k_epilogue
    from skyline.ops.pdl import pdl_wait

    # One int32 word of weights (8 nibbles, unsigned) against two words of int8 x: the low
    # nibbles (even elements) times xa's bytes plus the high nibbles (odd elements) times xb's,
    # exact in int32. Five instructions per eight weights.
    _DP4A_INT4 = tl.constexpr("""
    {
    .reg .b32 lo, hi;
    and.b32 lo, $1, 0x0F0F0F0F;
    shr.u32 hi, $1, 4;
    and.b32 hi, hi, 0x0F0F0F0F;
    dp4a.u32.s32 $0, lo, $2, 0;
    dp4a.u32.s32 $0, hi, $3, $0;
    }
    """)

    @triton.jit
    def _dot_words(w, xa, xb, ASM: tl.constexpr):
        if ASM:
            return tl.inline_asm_elementwise(_DP4A_INT4, "=r,r,r,r", [w, xa, xb],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:  # portable: the same sum byte by byte (x's bytes sign-extended)
            acc = tl.zeros_like(w)
            for b in tl.static_range(4):
                lo = (w >> (8 * b)) & 0xF
                hi = (w >> (8 * b + 4)) & 0xF
                acc += lo * ((xa << (24 - 8 * b)) >> 24) + hi * ((xb << (24 - 8 * b)) >> 24)
            return acc

    @triton.jit
    def round_half_away(v):
        return (v + tl.where(v < 0, -0.5, 0.5)).to(tl.int32)  # the conversion truncates

    @triton.jit
    def round_words(xe, xo, xq_ptr, xf_ptr, m, M, KC, chunk0, XQ: tl.constexpr,
                    INT8_MAX: tl.constexpr):
        # Chunks [chunk0, chunk0 + XQ) of 32 columns of row m of x, given as float32 values
        # xe / xo [XQ, 4 words, 4 bytes] (column 32c + 8j + 2b and the one after it), stored as
        # int8 words and per-chunk floats: xq [2, M, 4 KC] (each word's even / odd elements, one
        # byte each), xf [M, KC, 2] (the chunk's scale, its sum of x_q times it; interleaved, so
        # that their loads in the GEMV take the layout of the scales' loads).
        offs_q = tl.arange(0, XQ)
        offs_j = tl.arange(0, 4)
        amax = tl.max(tl.max(tl.maximum(tl.abs(xe), tl.abs(xo)), axis=2), axis=1)
        sx, inv = absmax_scales(amax, INT8_MAX)  # [XQ]
        qe = round_half_away(xe * inv[:, None, None])
        qo = round_half_away(xo * inv[:, None, None])
        shifts = (tl.arange(0, 4) * 8)[None, None, :]
        xa = tl.sum((qe & 0xFF) << shifts, axis=2)  # [XQ, 4] words
        xb = tl.sum((qo & 0xFF) << shifts, axis=2)
        chunks = chunk0 + offs_q
        words = chunks[:, None] * 4 + offs_j[None, :]
        ok = chunks < KC
        base = m * KC * 4 + words
        tl.store(xq_ptr + base, xa, mask=ok[:, None])
        tl.store(xq_ptr + M * KC * 4 + base, xb, mask=ok[:, None])
        v = tl.sum(tl.sum(qe + qo, axis=2), axis=1).to(tl.float32) * sx
        tl.store(xf_ptr + (m * KC + chunks) * 2, sx, mask=ok)
        tl.store(xf_ptr + (m * KC + chunks) * 2 + 1, v, mask=ok)

    @triton.jit
    def round_row_to_words(y, xq_ptr, xf_ptr, m, M, KC, chunk0, XQ: tl.constexpr,
                           INT8_MAX: tl.constexpr):
        # round_words over y [XQ * 32] in registers: the columns of chunks chunk0 ...
        xe, xo = tl.split(tl.reshape(y, (XQ, 4, 4, 2)))
        round_words(xe, xo, xq_ptr, xf_ptr, m, M, KC, chunk0, XQ, INT8_MAX)

    @triton.jit
    def quantize_x_words_kernel(x_ptr, xq_ptr, xf_ptr, M, K, KC, stride_xm, XQ: tl.constexpr,
                                INT8_MAX: tl.constexpr, PDL: tl.constexpr):
        # Program (m, block): XQ chunks of row m of x by round_words.
        pdl_wait(PDL)
        m = tl.program_id(0)
        cols = (tl.program_id(1) * XQ * 32 + tl.arange(0, XQ)[:, None, None] * 32
                + tl.arange(0, 4)[None, :, None] * 8
                + tl.arange(0, 4)[None, None, :] * 2)  # even, [XQ, 4, 4]
        row = x_ptr + m * stride_xm
        xe = tl.load(row + cols, mask=cols < K, other=0.0).to(tl.float32)
        xo = tl.load(row + cols + 1, mask=cols + 1 < K, other=0.0).to(tl.float32)
        round_words(xe, xo, xq_ptr, xf_ptr, m, M, KC, tl.program_id(1) * XQ, XQ, INT8_MAX)

    @triton.jit
    def gemv_int4_a8_kernel(
        w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, xq_ptr, xf_ptr,
        M, N, KC, k_iters, num_splits, stride_wn, stride_sn, stride_sg,
        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, STATIC_ITERS: tl.constexpr,
        PREFETCH: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    ):
        # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the K tiles
        # [pid_k * k_iters, +k_iters), streaming [BLOCK_K / 32, BLOCK_N, 4] weight words (chunk
        # c of a row: words 4c .. 4c + 3, columns 32c .. 32c + 31; word w's low nibbles are
        # columns 8w, 8w + 2, .., its high ones 8w + 1, ..). Tiles are [chunks, BLOCK_N,
        # BLOCK_M, 4 words]: the loads spread their threads over chunks, so a thread holds all
        # BLOCK_N rows of its chunks and loads x's words and per-chunk floats ([chunks, 1,
        # BLOCK_M, .]) once for all of them, from L1. Everything is loaded in the layout of the
        # words it meets, so nothing changes layout inside the loop (for BLOCK_K / 32 chunks at
        # least as many as the threads: smaller tiles leave warps without chunks of their own).
        # A chunk's four dp4a sums add up exactly in int32, then
        # scale * (dot * x_scale - zero * x_scale * sum(x_q)) joins the float32 sum.
        # PREFETCH (EVEN_K): the next tile's words are loaded before this one's are used;
        # always with PDL, where the first tile's are loaded before the wait for the previous
        # kernel (no kernel of a step writes weights), so their latency overlaps its end.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        BC: tl.constexpr = BLOCK_K // 32
        c_start = pid_k * k_iters * BC
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_c = tl.arange(0, BC)
        offs_j = tl.arange(0, 4)
        n_mask = offs_n < N
        m_mask = offs_m < M
        c4 = offs_c[:, None, None, None]
        n4 = offs_n[None, :, None, None]
        m4 = offs_m[None, None, :, None]
        j4 = offs_j[None, None, None, :]
        w_ptrs = (w_ptr + n4.to(tl.int64) * stride_wn + (c_start + c4) * 4
                  + j4)  # [BC, BLOCK_N, 1, 4]
        x_offs = m4 * (KC * 4) + (c_start + c4) * 4 + j4  # [BC, 1, BLOCK_M, 4]
        f_offs = (m4 * KC + c_start + c4) * 2  # [BC, 1, BLOCK_M, 1]
        g_offs = n4 * stride_sn + tl.zeros((BC, 1, 1, 1), dtype=tl.int32)  # [BC, BLOCK_N, 1, 1]
        n_ok = n4 < N
        x_ok = (m4 < M) & (j4 >= 0)
        f_ok = m4 < M
        acc = tl.zeros((BC, BLOCK_N, BLOCK_M, 1), dtype=tl.float32)
        n_iters = STATIC_ITERS if STATIC_ITERS > 0 else k_iters
        PF: tl.constexpr = (PREFETCH or PDL) and EVEN_K
        if PF:
            w_next = tl.load(w_ptrs, mask=n_ok, other=0)
        pdl_wait(PDL)
        # (the interpreter cannot loop to a runtime bound; it gets the count as a constant)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            c0 = c_start + it * BC
            w_mask = n_ok  # [1, BLOCK_N, 1, 1], or [BC, BLOCK_N, 1, 1] past here
            xw_mask = x_ok
            f_mask = f_ok
            if not EVEN_K:
                # a chunk that starts at or past K (past the weights' padded Kp and the x
                # buffers' KC) loads nothing
                in_k = (c0 + offs_c)[:, None, None, None] < KC
                w_mask = w_mask & in_k
                xw_mask = xw_mask & in_k
                f_mask = f_mask & in_k
            if PF:
                wv = w_next
                more = (offs_n * 0 + it + 1 < n_iters)[None, :, None, None]
                w_next = tl.load(w_ptrs + BC * 4, mask=n_ok & more, other=0)
            else:
                wv = tl.load(w_ptrs, mask=w_mask, other=0)
            g = ((c0 + offs_c) * 32 // GROUP)[:, None, None, None] * stride_sg
            s = tl.load(s_ptr + g_offs + g, mask=w_mask, other=0.0)
            z = tl.load(z_ptr + g_offs + g, mask=w_mask, other=0).to(tl.float32)
            xo = x_offs + it * BC * 4
            xa = tl.load(xq_ptr + xo, mask=xw_mask, other=0)
            xb = tl.load(xq_ptr + M * KC * 4 + xo, mask=xw_mask, other=0)
            fo = f_offs + it * BC * 2
            u = tl.load(xf_ptr + fo, mask=f_mask, other=0.0)
            v = tl.load(xf_ptr + fo + 1, mask=f_mask, other=0.0)
            d = tl.sum(_dot_words(wv, xa, xb, ASM), axis=3, keep_dims=True).to(tl.float32)
            acc += s * (d * u - z * v)
            w_ptrs += BC * 4
        out = tl.sum(tl.sum(acc, axis=3), axis=0)
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)
