"""Triton kernels of the MoE decode GEMVs (ops/moe_gemv.py holds the configurations, the
launcher and the contract; ops/moe.py's fused_moe_ref is the reference): `up_kernel` (gate and
up rows of a pair's expert, the activation fused) and `down_kernel` (a token's k experts' down
rows, routing weights and the top-k sum fused), in the float mode (dense, fp8, MXFP4 decoded in
registers) or MXFP4's integer mode (A8: through the dense block GEMV's `_fp4_a8`).
"""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.gemv_block_a8_triton import _fp4_a8, _fp4_codes
    from skyline.ops.moe_triton import _e2m1_to_f32_scaled, _e8m0_to_f32

    @triton.jit
    def _expert(ids_ptr, map_ptr, p, HAS_MAP: tl.constexpr):
        # pair p's expert among this rank's (-1: another rank's)
        e = tl.load(ids_ptr + p).to(tl.int32)
        if HAS_MAP:
            e = tl.load(map_ptr + e).to(tl.int32)
        return e

    @triton.jit
    def _acc_zeros(FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One return: the compiler checks every return statement of a function against the
        # others, a branch on a constexpr included (the interpreter does not).
        if FMT == 2:  # one partial sum per row and scale group
            acc = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        return acc

    @triton.jit
    def _rows_dot(acc, a_row, a_ok, w_rows, s_rows, n, n_ok, k0, K: tl.constexpr,
                  stride_wn, stride_sn, stride_sk, FMT: tl.constexpr,
                  CHANNEL_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # acc fp32 += W[n, tile] * a[tile]: elementwise [BLOCK_N, BLOCK_K] (FMAs reduced over
        # K at the end), or for MXFP4 one sum per row and scale group [BLOCK_N, BLOCK_K / 32]
        # (each group's 16 bytes reduced in registers, then times its scale). W's rows at
        # w_rows (the expert's first row), scales at s_rows; a read where a_ok. Dense and fp8
        # load a spread over the whole tile, in W's layout (L1 hits; no layout conversion of
        # W); MXFP4 loads the tile's BLOCK_K values of a once, contiguous, and splits them
        # into the even (low nibbles') and odd (high nibbles') columns in registers.
        if FMT == 2:
            g = tl.arange(0, BLOCK_K // 32)
            kb = k0 // 2 + g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16] bytes
            byte = tl.load(w_rows + n[:, None, None] * stride_wn + kb[None, :, :],
                           mask=n_ok[:, None, None] & (kb * 2 < K)[None, :, :],
                           other=0)  # [BLOCK_N, G, 16]
            gk = k0 // 32 + g
            scale = _e8m0_to_f32(tl.load(s_rows + n[:, None] * stride_sn
                                         + gk[None, :] * stride_sk,
                                         mask=n_ok[:, None] & (gk * 32 < K)[None, :],
                                         other=0))  # [BLOCK_N, G]
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_row + kk, mask=(kk < K) & a_ok, other=0.0).to(tl.float32)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_K // 32, 16, 2)))  # [G, 16] each
            lo = _e2m1_to_f32_scaled(byte & 0x0F)
            hi = _e2m1_to_f32_scaled(byte >> 4)
            dot = tl.sum(lo * a_even[None, :, :] + hi * a_odd[None, :, :], axis=2)
            acc += dot * (scale * 16384.0)  # 2^14: the decode's 2^-14 undone
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + n[:, None] * stride_wn + kk[None, :], mask=mask, other=0)
            if FMT == 1:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                if not CHANNEL_SCALE:  # the tile lies in one scale block per row
                    w = w * tl.load(s_rows + (n // SCALE_BN) * stride_sn
                                    + (k0 // SCALE_BK) * stride_sk, mask=n_ok,
                                    other=0.0)[:, None]
            else:
                w = w.to(tl.float32)
            zero = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
            a = tl.load(a_row + kk[None, :] + zero, mask=k_ok[None, :] & a_ok, other=0.0)
            acc += w * a.to(tl.float32)
        return acc

    @triton.jit
    def _rows_a8(xq_ptr, xf_ptr, w32_rows, s_rows, n, row, K: tl.constexpr, stride_wn,
                 stride_sn, ASM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
        # [BLOCK_N] float32: MXFP4 rows n (clamped to the expert's, so unmasked) at w32_rows
        # (int32 words) against row `row` of the rounded activations, by the dense integer
        # GEMV's tile function
        acc = tl.zeros((BLOCK_K // 32, BLOCK_N, 1), dtype=tl.float32)
        m = tl.zeros((1,), dtype=tl.int32) + row
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            wv = _fp4_codes(w32_rows, n, m, k0, K, stride_wn // 4, BLOCK_K // 32, True, EVEN_K)
            acc = _fp4_a8(xq_ptr, xf_ptr, wv, s_rows, n, m, k0, K, K // 32, stride_sn, acc,
                          True, ASM, EVEN_K)
        return tl.sum(tl.sum(acc, axis=0), axis=1)

    @triton.jit
    def up_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, map_ptr, route_ptr, h_ptr, xq_ptr, xf_ptr,
        w32_ptr, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be,
        N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, FMT: tl.constexpr,
        A8: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
        CHANNEL_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, SWIGLU: tl.constexpr,
        LIMIT: tl.constexpr, HAS_LIMIT: tl.constexpr, ALPHA: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
        UNROLL: tl.constexpr,
    ):
        # h[p, n] = act(gate, up) for n in this program's BLOCK_N of the I = N columns:
        # gate = W[e, n] . x[t], up = W[e, N + n] . x[t], e = pair p's expert, t = p // TOP_K.
        p = tl.program_id(0)
        e = _expert(ids_ptr, map_ptr, p, HAS_MAP)
        if e < 0:  # another rank's expert: h's row is never read
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        x_row = x_ptr + (p // TOP_K).to(tl.int64) * K
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        w_up = w_e + N * stride_wn
        s_up = s_e + (N // SCALE_BN) * stride_sn  # SCALE_BN divides N (1 unless fp8 blocks)
        acc_g = _acc_zeros(FMT, BLOCK_N, BLOCK_K)
        acc_u = _acc_zeros(FMT, BLOCK_N, BLOCK_K)
        x_ok = p >= 0  # always: x's row is the token's
        if A8:
            rows = tl.minimum(n, N - 1).to(tl.int64)
            w32_e = w32_ptr + e.to(tl.int64) * (stride_we // 4)
            gate = _rows_a8(xq_ptr, xf_ptr, w32_e, s_e, rows, p // TOP_K, K, stride_wn,
                            stride_sn, ASM, EVEN_K, BLOCK_N, BLOCK_K, NUM_STAGES)
            up = _rows_a8(xq_ptr, xf_ptr, w32_e + N * (stride_wn // 4), s_up, rows, p // TOP_K,
                          K, stride_wn, stride_sn, ASM, EVEN_K, BLOCK_N, BLOCK_K, NUM_STAGES)
        elif UNROLL:  # every K tile's loads independent in straight-line code
            for k0 in tl.static_range(0, K, BLOCK_K):
                acc_g = _rows_dot(acc_g, x_row, x_ok, w_e, s_e, n, n_ok, k0, K, stride_wn,
                                  stride_sn, stride_sk, FMT, CHANNEL_SCALE, SCALE_BN, SCALE_BK,
                                  BLOCK_N, BLOCK_K)
                acc_u = _rows_dot(acc_u, x_row, x_ok, w_up, s_up, n, n_ok, k0, K, stride_wn,
                                  stride_sn, stride_sk, FMT, CHANNEL_SCALE, SCALE_BN, SCALE_BK,
                                  BLOCK_N, BLOCK_K)
        else:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                acc_g = _rows_dot(acc_g, x_row, x_ok, w_e, s_e, n, n_ok, k0, K, stride_wn,
                                  stride_sn, stride_sk, FMT, CHANNEL_SCALE, SCALE_BN, SCALE_BK,
                                  BLOCK_N, BLOCK_K)
                acc_u = _rows_dot(acc_u, x_row, x_ok, w_up, s_up, n, n_ok, k0, K, stride_wn,
                                  stride_sn, stride_sk, FMT, CHANNEL_SCALE, SCALE_BN, SCALE_BK,
                                  BLOCK_N, BLOCK_K)
        if not A8:
            gate = tl.sum(acc_g, axis=1)
            up = tl.sum(acc_u, axis=1)
        if CHANNEL_SCALE:
            gate *= tl.load(s_e + n * stride_sn, mask=n_ok, other=0.0)
            up *= tl.load(s_up + n * stride_sn, mask=n_ok, other=0.0)
        if HAS_BIAS:
            b_e = b_ptr + e.to(tl.int64) * stride_be
            gate += tl.load(b_e + n, mask=n_ok, other=0.0).to(tl.float32)
            up += tl.load(b_e + N + n, mask=n_ok, other=0.0).to(tl.float32)
        if SWIGLU:  # gpt-oss: gate * sigmoid(1.702 gate) * (up + 1), clamped at LIMIT
            if HAS_LIMIT:
                gate = tl.minimum(gate, LIMIT)
                up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            act = gate * tl.sigmoid(gate * ALPHA) * (up + 1.0)
        else:
            act = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + p.to(tl.int64) * N + n, act.to(h_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def down_kernel(
        h_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, map_ptr, route_ptr, out_ptr, xq_ptr, xf_ptr,
        w32_ptr, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be,
        N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, FMT: tl.constexpr,
        A8: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
        CHANNEL_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, SWIGLU: tl.constexpr,
        LIMIT: tl.constexpr, HAS_LIMIT: tl.constexpr, ALPHA: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
        UNROLL: tl.constexpr,
    ):
        # out[t, n] = sum_j route[t, j] * (W[e_j, n] . h[t * TOP_K + j] + b[e_j, n]) over this
        # program's BLOCK_N of the H = N columns; pairs of other ranks' experts load nothing.
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = t * TOP_K + j
            e = _expert(ids_ptr, map_ptr, p, HAS_MAP)
            held = e >= 0
            e_ok = tl.maximum(e, 0).to(tl.int64)
            rows_ok = n_ok & held
            w_e = w_ptr + e_ok * stride_we
            s_e = s_ptr + e_ok * stride_se
            h_row = h_ptr + p.to(tl.int64) * K
            acc = _acc_zeros(FMT, BLOCK_N, BLOCK_K)
            if A8:  # another rank's expert reads nothing
                y = tl.zeros((BLOCK_N,), dtype=tl.float32)
                if held:
                    y = _rows_a8(xq_ptr, xf_ptr, w32_ptr + e_ok * (stride_we // 4), s_e,
                                 tl.minimum(n, N - 1).to(tl.int64), p, K, stride_wn, stride_sn,
                                 ASM, EVEN_K, BLOCK_N, BLOCK_K, NUM_STAGES)
            elif UNROLL:  # the k experts' tiles too: nothing orders their loads
                for k0 in tl.static_range(0, K, BLOCK_K):
                    acc = _rows_dot(acc, h_row, held, w_e, s_e, n, rows_ok, k0, K, stride_wn,
                                    stride_sn, stride_sk, FMT, CHANNEL_SCALE, SCALE_BN,
                                    SCALE_BK, BLOCK_N, BLOCK_K)
            else:
                for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                    acc = _rows_dot(acc, h_row, held, w_e, s_e, n, rows_ok, k0, K, stride_wn,
                                    stride_sn, stride_sk, FMT, CHANNEL_SCALE, SCALE_BN,
                                    SCALE_BK, BLOCK_N, BLOCK_K)
            if not A8:
                y = tl.sum(acc, axis=1)
            if CHANNEL_SCALE:
                y *= tl.load(s_e + n * stride_sn, mask=rows_ok, other=0.0)
            if HAS_BIAS:
                y += tl.load(b_ptr + e_ok * stride_be + n, mask=rows_ok, other=0.0).to(
                    tl.float32)
            # h's rows of other ranks' pairs were never written: their products are masked
            # to zero above, and their weight is zeroed here (0 * garbage could be NaN)
            w_route = tl.load(route_ptr + p).to(tl.float32)
            total += tl.where(rows_ok, y * w_route, 0.0)
        tl.store(out_ptr + t.to(tl.int64) * N + n, total.to(out_ptr.dtype.element_ty),
                 mask=n_ok)
