"""Triton kernels of the paged prefill/extend attention (ops/attention_ref.py holds their
PyTorch reference, ops/attention.py their launchers; the tile helpers they share with the decode
kernel are in ops/attention_triton.py): one grid axis per sequence (`paged_prefill_kernel`, its
launch sized by the longest query run), or one flattened axis of query tiles found from
query_start_loc on the device (`paged_prefill_varlen_kernel`, its launch sized by the token and
sequence counts alone, as a CUDA graph of mixed steps needs). Both run the same program per
tile (`_prefill_program`), so they compute the same numbers for the same launch configuration."""

from __future__ import annotations

from skyline.ops.triton_utils import tl, triton

if triton is not None:
    from skyline.ops.attention_triton import _add_sinks, _load_kv_tile, _page_ids, _query_dtype
    from skyline.ops.pdl import pdl_wait

    @triton.jit
    def _attend_tile_exp2(q, k, v, see, m, l_sum, acc, qk_scale, IEEE: tl.constexpr,
                          MASKED: tl.constexpr):
        # _attend_tile in base 2 (`qk_scale` includes log2(e); m is in log2 units) for the
        # prefill loop. Unmasked tiles (MASKED False: every query sees every key of the tile)
        # skip the mask and the guard for rows that have seen nothing.
        if IEEE:  # fp32: exact, not the tensor cores' tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        if MASKED:
            # rows that see nothing yet keep m = -inf; shift by 0 there to avoid inf - inf
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            shift = m_new
        p = tl.math.exp2(s - shift[:, None])
        alpha = tl.math.exp2(m - shift)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _prefill_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, q_pos, blk, start, end,
                      offs, d, dmask, m, l_sum, acc, qk_scale, window, stride_bt, stride_kb,
                      stride_ks, stride_kh, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr, FP8_WORDS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      D_PAD: tl.constexpr, MASKED: tl.constexpr):
        # The prefill loop body: context positions [start, start + BLOCK_N) on pages `blk`.
        # Returns the new (m, l_sum, acc) and the next tile's page ids.
        pos = start + offs
        valid = pos < end
        blk_next = _page_ids(block_tables_ptr, seq, pos + BLOCK_N, end, stride_bt, PAGE)
        k, v = _load_kv_tile(k_ptr, v_ptr, blk, kvh, pos, valid, d, dmask, stride_kb, stride_ks,
                             stride_kh, PAGE, q.dtype, FP8_WORDS, HEAD_DIM, D_PAD)
        # causal and within the window, [M, N]
        see = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (
            q_pos[:, None] - pos[None, :] < window)
        m, l_sum, acc = _attend_tile_exp2(q, k, v, see, m, l_sum, acc, qk_scale, IEEE, MASKED)
        return m, l_sum, acc, blk_next

    @triton.jit
    def _prefill_program(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq, head0, tile, q_start, q_len,
        seq_len, scale, v_scale, window, sinks_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr, F16: tl.constexpr,
        FP8_WORDS: tl.constexpr, PACK: tl.constexpr, PACK_PAD: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        # Query tokens [tile * BLOCK_M, (tile + 1) * BLOCK_M) of sequence `seq` (its new tokens
        # are q rows q_start.. q_start + q_len, its context seq_len long), for the PACK query
        # heads from head0: the heads' queries are the rows of one [BLOCK_M * PACK_PAD, D] tile
        # (token-major), so each K/V tile is read once for all of them. Query j of a sequence
        # sits at absolute position seq_len - q_len + j and sees keys up to it, and none
        # `window` or more positions before it (a huge window: all). SINKS: each head's sink
        # logit joins the softmax's denominator. `scale` includes the fp8 k_scale; v_scale
        # multiplies the accumulated output.
        kvh = head0 // GROUP
        r = tl.arange(0, BLOCK_M * PACK_PAD)
        tok = tile * BLOCK_M + r // PACK_PAD  # [R] query token within the sequence's new ones
        head = head0 + r % PACK_PAD
        row_ok = (tok < q_len) & (r % PACK_PAD < PACK)
        q_pos = seq_len - q_len + tok  # [R]
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dmask[None, :], other=0.0)  # [R, D]
        q = _query_dtype(q, F16)
        m = tl.full([BLOCK_M * PACK_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M * PACK_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * PACK_PAD, D_PAD], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        # keys this tile can see: up to its last query's position (tiles past q_len see none),
        # from the first its first query's window reaches
        active = tile * BLOCK_M < q_len
        first_q = seq_len - q_len + tile * BLOCK_M
        end = tl.where(active, tl.minimum(seq_len, first_q + BLOCK_M), 0)
        lo = tl.where(active, tl.maximum(first_q - window + 1, 0), 0)
        # Keys every query of the tile sees (before its first query, within its last one's
        # window) run without the mask: tiles [mid, full_end) of the BLOCK_N grid from lo; the
        # others (the window's edge, the diagonal) with it. Without a window, lo = mid = 0.
        mid = lo + tl.cdiv(tl.maximum(end - window - lo, 0), BLOCK_N) * BLOCK_N
        full_end = mid + tl.maximum(first_q - mid, 0) // BLOCK_N * BLOCK_N
        full_end = tl.where(active, full_end, mid)
        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
        blk = _page_ids(block_tables_ptr, seq, lo + offs, end, stride_bt, PAGE)
        for span in tl.static_range(3):  # masked, unmasked, masked
            if span == 0:
                span_lo, span_hi = lo, mid
            elif span == 1:
                span_lo, span_hi = mid, full_end
            else:
                span_lo, span_hi = full_end, end
            if PIPELINE:
                for start in tl.range(span_lo, span_hi, BLOCK_N, num_stages=NUM_STAGES):
                    m, l_sum, acc, blk = _prefill_tile(
                        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, q_pos, blk, start,
                        end, offs, d, dmask, m, l_sum, acc, qk_scale, window, stride_bt,
                        stride_kb, stride_ks, stride_kh, PAGE, BLOCK_N, IEEE, FP8_WORDS,
                        HEAD_DIM, D_PAD, span != 1)
            else:
                start = span_lo
                while start < span_hi:
                    m, l_sum, acc, blk = _prefill_tile(
                        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, q_pos, blk, start,
                        end, offs, d, dmask, m, l_sum, acc, qk_scale, window, stride_bt,
                        stride_kb, stride_ks, stride_kh, PAGE, BLOCK_N, IEEE, FP8_WORDS,
                        HEAD_DIM, D_PAD, span != 1)
                    start += BLOCK_N
        if SINKS:  # m is in log2 units here
            acc, l_sum = _add_sinks(sinks_ptr, head, row_ok, m, l_sum, acc, True)
        out = acc * v_scale / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dmask[None, :])

    @triton.jit(do_not_specialize=["stride_bt"],
                do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "qsl_ptr"])
    def paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale, v_scale,
        window, sinks_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr, F16: tl.constexpr,
        PDL: tl.constexpr, FP8_WORDS: tl.constexpr = 0, PACK: tl.constexpr = 1,
        PACK_PAD: tl.constexpr = 1, SINKS: tl.constexpr = False,
    ):
        # One program per (sequence, PACK query heads of one kv head, tile of BLOCK_M query
        # tokens): _prefill_program. Tiles run last first: the last tiles of a causal prefill
        # see the most keys, so the long programs start first and the short ones fill the tail.
        pdl_wait(PDL)
        seq = tl.program_id(0)
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        _prefill_program(
            q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq, tl.program_id(1) * PACK, tile,
            q_start, q_len, seq_len, scale, v_scale, window, sinks_ptr,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot,
            stride_oh, GROUP, HEAD_DIM, D_PAD, PAGE, BLOCK_M, BLOCK_N, IEEE, PIPELINE,
            NUM_STAGES, F16, FP8_WORDS, PACK, PACK_PAD, SINKS)

    @triton.jit(do_not_specialize=["stride_bt", "num_seqs"],
                do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "qsl_ptr"])
    def paged_prefill_varlen_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale, v_scale,
        window, sinks_ptr, num_seqs,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr, F16: tl.constexpr,
        PDL: tl.constexpr, S_PAD: tl.constexpr, FP8_WORDS: tl.constexpr = 0,
        PACK: tl.constexpr = 1, PACK_PAD: tl.constexpr = 1, SINKS: tl.constexpr = False,
    ):
        # Programs over a flattened list of query tiles, for PACK query heads each: the launch
        # depends on the token and sequence counts only. Every program reads the whole
        # query_start_loc (one vector load) and numbers the tiles of the sequences of two or
        # more query tokens (cdiv(q_len, BLOCK_M) each; sequences of one token are the decode
        # kernel's, padding sequences have none) by a prefix sum; it runs tiles p, p + grid,
        # ... of them, last first (as paged_prefill_kernel's, the long tiles of a causal
        # prefill start first). A grid of num_tokens / BLOCK_M + a few programs gives the
        # usual step (decodes and a few prompt chunks) one tile a program, where a grid of
        # one program a sequence would launch hundreds that exit at once.
        pdl_wait(PDL)
        s = tl.arange(0, S_PAD)
        live = s < num_seqs
        starts = tl.load(qsl_ptr + s, mask=live, other=0)
        q_lens = tl.load(qsl_ptr + s + 1, mask=live, other=0) - starts
        tiles = tl.where(q_lens > 1, (q_lens + BLOCK_M - 1) // BLOCK_M, 0)
        ends = tl.cumsum(tiles, 0)  # past each sequence's last tile
        total = tl.sum(tiles, 0)
        w = tl.program_id(0)
        while w < total:
            r = total - 1 - w
            seq = tl.sum((ends <= r).to(tl.int32), 0)  # the first sequence ending past r
            mine = s == seq
            q_start = tl.sum(tl.where(mine, starts, 0), 0)
            q_len = tl.sum(tl.where(mine, q_lens, 0), 0)
            tile = r - tl.sum(tl.where(mine, ends - tiles, 0), 0)
            seq_len = tl.load(seq_lens_ptr + seq)
            _prefill_program(
                q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq, tl.program_id(1) * PACK,
                tile, q_start, q_len, seq_len, scale, v_scale, window, sinks_ptr,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot,
                stride_oh, GROUP, HEAD_DIM, D_PAD, PAGE, BLOCK_M, BLOCK_N, IEEE, PIPELINE,
                NUM_STAGES, F16, FP8_WORDS, PACK, PACK_PAD, SINKS)
            w += tl.num_programs(0)
