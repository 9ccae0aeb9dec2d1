"""A step's flat inputs (worker/inputs.py) against a token-by-token reference."""

from __future__ import annotations

import random

import pytest
import torch

from skyline.types import SamplingParams
from skyline.worker.inputs import RequestState, build_inputs

BS = 4  # block size


def _reference(states, num_scheduled, spec, in_flight):
    """Token by token: ids, positions, slots, block table rows, logits rows, samplers."""
    order = [r for r in num_scheduled if num_scheduled[r] == 1]
    order += [r for r in num_scheduled if num_scheduled[r] != 1]
    ids, pos, slots, rows, logits, sampling = [], [], [], [], [], []
    for rid in order:
        s, n = states[rid], num_scheduled[rid]
        drafts = spec.get(rid, [])
        known = s.token_ids + [in_flight[0].get(rid) if in_flight else None]  # None: never read
        for k, p in enumerate(range(s.num_computed_tokens, s.num_computed_tokens + n)):
            real = n - len(drafts)
            ids.append(known[p] if k < real else drafts[k - real])
            pos.append(p)
            slots.append(s.block_ids[p // BS] * BS + p % BS)
        rows.append(list(s.block_ids))
        end = s.num_computed_tokens + n - len(drafts)
        if end >= len(s.token_ids):
            logits += list(range(len(ids) - 1 - len(drafts), len(ids)))
            sampling.append(rid)
    return order, ids, pos, slots, rows, logits, sampling


def _state(rid: str, rng: random.Random, num_tokens: int, computed: int,
           slots_needed: int) -> RequestState:
    toks = [rng.randrange(1000) for _ in range(num_tokens)]
    blocks = rng.sample(range(10_000), -(-slots_needed // BS))
    return RequestState(rid, toks[:3], toks[3:], SamplingParams(), blocks, computed, toks)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("async_decodes", [False, True])
def test_build_inputs_matches_token_by_token(seed, async_decodes):
    rng = random.Random(seed)
    states, sched, spec = {}, {}, {}
    prev_rows: dict[str, int] = {}
    for i in range(rng.randrange(1, 12)):
        rid = f"r{i}"
        kind = rng.choice(["decode", "prefill", "chunk", "drafts"])
        n_tok = rng.randrange(4, 40)
        if kind == "decode" and async_decodes:
            # the token to feed is still on the device (the previous step sampled it)
            states[rid] = _state(rid, rng, n_tok, n_tok, n_tok + 1)
            sched[rid] = 1
            prev_rows[rid] = len(prev_rows)
        elif kind == "decode":
            states[rid] = _state(rid, rng, n_tok, n_tok - 1, n_tok)
            sched[rid] = 1
        elif kind == "prefill":
            states[rid] = _state(rid, rng, n_tok, 0, n_tok)
            sched[rid] = n_tok
        elif kind == "chunk":  # the middle of a chunked prefill: nothing sampled
            done = rng.randrange(0, n_tok - 2)
            n = rng.randrange(1, n_tok - done - 1)
            states[rid] = _state(rid, rng, n_tok, done, done + n)
            sched[rid] = n
        else:  # the last token and its drafts
            k = rng.randrange(1, 4)
            states[rid] = _state(rid, rng, n_tok, n_tok - 1, n_tok + k)
            sched[rid] = 1 + k
            spec[rid] = [rng.randrange(1000) for _ in range(k)]
    prev_tokens = torch.tensor([5000 + j for j in range(len(prev_rows))])
    in_flight = ({r: 5000 + j for r, j in prev_rows.items()}, prev_tokens) if prev_rows else None
    inp = build_inputs(states, sched, BS, torch.device("cpu"), spec,
                       (prev_rows, prev_tokens) if prev_rows else None)
    order, ids, pos, slots, rows, logits, sampling = _reference(states, sched, spec, in_flight)
    assert inp.req_ids == order
    assert inp.input_ids.tolist() == ids
    assert inp.positions.tolist() == pos
    assert inp.attn.slot_mapping.tolist() == slots
    table = inp.attn.block_tables
    assert table.dtype == torch.int32 and table.shape[0] == len(order)
    for got, want in zip(table.tolist(), rows, strict=True):
        assert got[: len(want)] == want and not any(got[len(want):])
    assert inp.logits_indices.tolist() == logits
    assert inp.sampling_req_ids == sampling
    a = inp.attn
    assert a.num_decodes == sum(1 for r in order if sched[r] == 1)
    assert a.seq_lens == [states[r].num_computed_tokens + sched[r] for r in order]
    assert a.seq_lens_tensor.tolist() == a.seq_lens
    assert a.query_start_loc_tensor.tolist() == a.query_start_loc
    assert a.query_start_loc[-1] == len(ids)
