"""Triton kernels of the paged attention (ops/attention_ref.py holds their PyTorch references,
ops/attention.py their launchers): decode (one query token per sequence, GQA-aware, optionally
split over the context) with its split combine, and the tile helpers they share with the
prefill/extend kernels (ops/attention_prefill_triton.py). K/V stream in BLOCK_N-token
tiles through a software-pipelined `tl.range` loop when compiled (PIPELINE), a `while` loop in
Triton's interpreter."""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.gemv_int_a8_triton import round_row_to_words
    from skyline.ops.pdl import pdl_wait

    @triton.jit
    def _page_ids(block_tables_ptr, seq, pos, end, stride_bt, PAGE: tl.constexpr):
        # Page ids of context positions `pos` [N] (0 at positions >= end), in one vector load.
        # The loops below load the next tile's ids one tile ahead and carry them: the K/V loads
        # then depend on a loop-carried value rather than on a load in the same iteration, so
        # the pipeliner gives them all num_stages - 1 buffers (an indirect load in the same
        # iteration would take half the stages for itself).
        return tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=pos < end, other=0)

    @triton.jit
    def _e4m3_byte(words, SHIFT: tl.constexpr):
        # (the interpreter converts the NaN code 0x7f / 0xff to -+480; the GPU's cvt to NaN)
        b = (words >> SHIFT) & 0xFF
        f16 = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), f16).to(tl.float16)

    # a word of four e4m3 bytes -> four fp16 ($0..$3: bytes 0..3), two per conversion
    _E4M3X4_TO_F16 = tl.constexpr(
        "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
        "cvt.rn.f16x2.e4m3x2 x, lo; cvt.rn.f16x2.e4m3x2 y, hi; "
        "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }")

    @triton.jit
    def _e4m3_words_to_f16(words, ASM: tl.constexpr):
        # [N, W] int32 words of four e4m3 bytes each -> [N, 4 W] fp16, byte j of word w at
        # column 4 w + j. ASM: two `cvt.rn.f16x2.e4m3x2` per word; else (Triton's interpreter)
        # each byte reinterpreted and converted.
        if ASM:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(
                _E4M3X4_TO_F16, "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4,
                is_pure=True, pack=1)
        else:
            b0 = _e4m3_byte(words, 0)
            b1 = _e4m3_byte(words, 8)
            b2 = _e4m3_byte(words, 16)
            b3 = _e4m3_byte(words, 24)
        f16 = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [N, W, 2, 2]: [.., j, i] = b(2 j + i)
        return tl.reshape(f16, (words.shape[0], 4 * words.shape[1]))

    @triton.jit
    def _load_kv_tile(k_ptr, v_ptr, blk, kvh, pos, valid, d, dmask, stride_kb, stride_ks,
                      stride_kh, PAGE: tl.constexpr, DTYPE: tl.constexpr, FP8_WORDS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
        # K and V rows of context positions `pos` [N] on pages `blk` [N], converted to the
        # compute dtype DTYPE (exact from fp8 e4m3; the kernels apply the fp8 scales to scores
        # and output, not to each element). FP8_WORDS (an fp8 cache, HEAD_DIM % 4 == 0): the
        # rows are read as int32 words and converted by _e4m3_words_to_f16 (ASM when 2). Read
        # as fp8, the compiler feeds V to the tensor cores from shared memory one byte at a
        # time (the MMA wants consecutive tokens in a register); from fp16 tiles it transposes
        # V with ldmatrix as it does a bf16 cache's.
        row = blk.to(tl.int64) * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh
        if FP8_WORDS:
            w = tl.arange(0, D_PAD // 4)
            w_mask = valid[:, None] & (w < HEAD_DIM // 4)[None, :]
            word = row[:, None] // 4 + w[None, :]
            k = tl.load(k_ptr.to(tl.pointer_type(tl.int32)) + word, mask=w_mask, other=0)
            v = tl.load(v_ptr.to(tl.pointer_type(tl.int32)) + word, mask=w_mask, other=0)
            k = _e4m3_words_to_f16(k, FP8_WORDS == 2)
            v = _e4m3_words_to_f16(v, FP8_WORDS == 2)
        else:
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        return k.to(DTYPE), v.to(DTYPE)

    @triton.jit
    def _query_dtype(q, F16: tl.constexpr):
        # With F16 (an fp8 cache under bf16 queries) the tiles are computed in fp16: e4m3 -> fp16
        # is one conversion per two elements where e4m3 -> bf16 takes several, and that
        # conversion, not the halved bytes, bounds the fp8 decode kernel. fp16 holds every e4m3
        # value exactly and has more mantissa than bf16; queries are clamped to its range.
        if F16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        return q

    @triton.jit
    def _attend_tile(q, k, v, see, m, l_sum, acc, scale, IEEE: tl.constexpr):
        # One online-softmax step of queries q [R, D] over keys k / values v [N, D], where
        # see [R, N] says which keys each query may attend to. Returns the new (m, l_sum, acc).
        if IEEE:  # fp32: exact, not the tensor cores' tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(see, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # rows that see nothing yet keep m = -inf; shift by 0 there to avoid inf - inf
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _decode_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, blk, start, end, offs, d,
                     dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks, stride_kh,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     FP8_WORDS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
        # The decode loop body: context positions [start, start + BLOCK_N) on pages `blk`.
        # Returns the new (m, l_sum, acc) and the next tile's page ids.
        pos = start + offs
        valid = pos < end
        blk_next = _page_ids(block_tables_ptr, seq, pos + BLOCK_N, end, stride_bt, PAGE)
        k, v = _load_kv_tile(k_ptr, v_ptr, blk, kvh, pos, valid, d, dmask, stride_kb, stride_ks,
                             stride_kh, PAGE, q.dtype, FP8_WORDS, HEAD_DIM, D_PAD)
        m, l_sum, acc = _attend_tile(q, k, v, valid[None, :], m, l_sum, acc, scale, IEEE)
        return m, l_sum, acc, blk_next

    @triton.jit
    def _add_sinks(sinks_ptr, heads, mask, m, l_sum, acc, BASE2: tl.constexpr = False):
        # The softmax state (m, l_sum, acc) of rows of heads `heads` [R] with each head's sink
        # logit added to the denominator: rescaled to max(m, sink). BASE2: m is in log2 units
        # (the prefill's exp2 softmax). Returns (acc, l_sum).
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32)
        if BASE2:
            sink = sink * 1.4426950408889634
        top = tl.maximum(m, sink)
        if BASE2:
            alpha = tl.math.exp2(m - top)  # 0 for rows that saw nothing (m = -inf)
            return acc * alpha[:, None], l_sum * alpha + tl.math.exp2(sink - top)
        alpha = tl.exp(m - top)
        return acc * alpha[:, None], l_sum * alpha + tl.exp(sink - top)

    @triton.jit(do_not_specialize=["num_splits", "stride_bt"],
                do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "qsl_ptr"])
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_ml_ptr, part_acc_ptr, block_tables_ptr, seq_lens_ptr,
        scale, v_scale, num_heads, num_splits, window, sinks_ptr, qsl_ptr,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        SPLIT: tl.constexpr, PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr,
        F16: tl.constexpr, PDL: tl.constexpr, FP8_WORDS: tl.constexpr = 0,
        SINKS: tl.constexpr = False, VARLEN: tl.constexpr = False,
    ):
        # One program per (sequence, kv head, KV split): all GROUP query heads sharing that kv
        # head read each K/V tile once. Online softmax over BLOCK_N-token tiles gathered via the
        # table. With SPLIT (flash-decoding), each of the num_splits programs of a sequence
        # covers one slice of the context and writes its partial (max, sum, acc) for
        # _combine_splits. `scale` includes the fp8 k_scale; v_scale multiplies the output.
        # Only the last `window` positions are read (sliding window; a huge window reads all).
        # SINKS (unsplit): the heads' sink logits join the softmax's denominator; split, the
        # combine kernel adds them.
        # VARLEN (a mixed step): q and out rows are tokens, sequence `seq`'s at qsl[seq], and
        # only sequences of exactly one query token run here (the prefill kernel takes the
        # others; padding sequences have none).
        pdl_wait(PDL)
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if VARLEN:
            row = tl.load(qsl_ptr + seq)
            if tl.load(qsl_ptr + seq + 1) - row != 1:
                return
        else:
            row = seq
        seq_len = tl.load(seq_lens_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G, D]
        q = _query_dtype(q, F16)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        lo = tl.maximum(seq_len - window, 0)
        if SPLIT:
            per = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
            start = lo + split * per
            end = tl.minimum(seq_len, start + per)
        else:
            start = lo
            end = seq_len
        blk = _page_ids(block_tables_ptr, seq, start + offs, end, stride_bt, PAGE)
        if PIPELINE:
            for tile in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                m, l_sum, acc, blk = _decode_tile(
                    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, blk, tile, end, offs, d,
                    dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks, stride_kh,
                    PAGE, BLOCK_N, IEEE, FP8_WORDS, HEAD_DIM, D_PAD)
        else:
            while start < end:
                m, l_sum, acc, blk = _decode_tile(
                    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, blk, start, end, offs, d,
                    dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks, stride_kh,
                    PAGE, BLOCK_N, IEEE, FP8_WORDS, HEAD_DIM, D_PAD)
                start += BLOCK_N
        acc = acc * v_scale
        if SPLIT:
            part = (seq * num_heads + heads) * num_splits + split  # [G] rows of [B, H, S]
            tl.store(part_ml_ptr + part * 2, m, mask=gmask)
            tl.store(part_ml_ptr + part * 2 + 1, l_sum, mask=gmask)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=gmask[:, None] & dmask[None, :])
        else:
            if SINKS:
                acc, l_sum = _add_sinks(sinks_ptr, heads, gmask, m, l_sum, acc)
            out = acc / l_sum[:, None]
            tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


    @triton.jit(do_not_specialize=["num_splits", "num_seqs"],
                do_not_specialize_on_alignment=["qsl_ptr"])
    def combine_splits_kernel(
        ml_ptr, acc_ptr, out_ptr, num_heads, stride_ob, stride_oh,
        num_splits, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, PDL: tl.constexpr, num_seqs=1, words_ptr=None, floats_ptr=None,
        INT8_OUT: tl.constexpr = False, INT8_MAX: tl.constexpr = 127.0, sinks_ptr=None,
        SINKS: tl.constexpr = False, qsl_ptr=None, VARLEN: tl.constexpr = False,
    ):
        # One program per (sequence, head): _combine_splits_ref in one launch. INT8_OUT
        # (HEAD_DIM == D_PAD, a multiple of 32): the head's values as stored are also rounded
        # to int8 words, chunks head * HEAD_DIM / 32 .. of the sequence's [heads * HEAD_DIM]
        # row (ops/gemv_int_a8_triton.round_row_to_words). VARLEN: as paged_decode_kernel's
        # (out rows are tokens; sequences without exactly one query token are skipped).
        pdl_wait(PDL)
        row = tl.program_id(0)
        seq, head = row // num_heads, row % num_heads
        if VARLEN:
            out_row = tl.load(qsl_ptr + seq)
            if tl.load(qsl_ptr + seq + 1) - out_row != 1:
                return
        else:
            out_row = seq
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        smask = s < num_splits
        base = row * num_splits + s
        m = tl.load(ml_ptr + base * 2, mask=smask, other=float("-inf"))
        l_sum = tl.load(ml_ptr + base * 2 + 1, mask=smask, other=0.0)
        top = tl.max(m, 0)
        if SINKS:  # one more split: max the sink, sum 1, nothing accumulated
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            top = tl.maximum(top, sink)
        w = tl.exp(m - top)  # [S]
        acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :],
                      mask=smask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [S, D]
        den = tl.sum(l_sum * w, 0)
        if SINKS:
            den += tl.exp(sink - top)
        out = tl.sum(acc * w[:, None], 0) / den
        tl.store(out_ptr + out_row * stride_ob + head * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
        if INT8_OUT:
            round_row_to_words(out.to(out_ptr.dtype.element_ty).to(tl.float32), words_ptr,
                               floats_ptr, seq, num_seqs, num_heads * (HEAD_DIM // 32),
                               head * (HEAD_DIM // 32), HEAD_DIM // 32, INT8_MAX)
