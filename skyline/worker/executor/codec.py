"""The step messages between the engine and its ranks, as msgpack.

A SchedulerOutput already sends new requests whole and known ones as diffs; on the wire the
diff of a known request is left out altogether when it says only what the rank's runner
computes itself (no new or freed blocks, and the tokens in its cache are those it held after
the previous step: its count then plus that step's scheduled tokens). A decode step of a
thousand requests is then, besides its request ids and counts, nearly empty, and the ranks
build no per-request objects for it (bench/parallel_overhead.py measures the cost).
"""

from __future__ import annotations

from typing import Any

import msgpack

from skyline.types import (
    CachedRequestData,
    KVTransfer,
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)


def pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class StepEncoder:
    """The engine's side: remembers, per running request, the tokens the ranks will hold in
    their caches after the last step it encoded."""

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}

    def encode(self, out: SchedulerOutput) -> bytes:
        computed = self.computed
        for rid in out.finished_request_ids:
            computed.pop(rid, None)
        scheduled = out.num_scheduled_tokens
        new = []
        for n in out.new_requests:
            new.append((n.request_id, n.prompt_token_ids, n.output_token_ids,
                        list(vars(n.sampling_params).values()), n.block_ids,
                        n.num_computed_tokens))
            computed[n.request_id] = n.num_computed_tokens + scheduled.get(n.request_id, 0)
        changed = []
        for c in out.cached_requests:  # one pass: at a thousand requests the loop is the cost
            rid, n = c.request_id, c.num_computed_tokens
            if c.new_block_ids or c.num_freed_blocks or computed.get(rid) != n:
                changed.append((rid, c.new_block_ids, n, c.num_freed_blocks))
            computed[rid] = n + scheduled.get(rid, 0)
        return pack((new, changed, list(scheduled), list(scheduled.values()),
                     out.total_num_scheduled_tokens, list(out.finished_request_ids),
                     out.token_masks, out.spec_token_ids, out.propose_drafts,
                     out.feed_proposer, [list(vars(t).values()) for t in out.kv_transfers],
                     out.kv_in_flight))


def decode_step(data: bytes) -> SchedulerOutput:
    """A rank's side: the SchedulerOutput its runner takes (with only the changed diffs)."""
    (new, changed, rids, counts, total, finished, masks, spec, propose,
     feed, transfers, kv_in_flight) = unpack(data)
    return SchedulerOutput(
        new_requests=[NewRequestData(rid, prompt, output, SamplingParams(*params), blocks,
                                     computed)
                      for rid, prompt, output, params, blocks, computed in new],
        cached_requests=[CachedRequestData(*c) for c in changed],
        num_scheduled_tokens=dict(zip(rids, counts, strict=True)),
        total_num_scheduled_tokens=total,
        finished_request_ids=set(finished),
        token_masks=masks,
        spec_token_ids=spec,
        propose_drafts=propose,
        feed_proposer=feed,
        kv_transfers=[KVTransfer(*t) for t in transfers],
        kv_in_flight=kv_in_flight,
    )


def encode_output(o: RunnerOutput) -> bytes:
    lps = None
    if any(lp is not None for lp in o.logprobs):
        lps = [None if lp is None else [_lp_wire(t) for t in lp]
               for lp in o.logprobs]
    prompt = {r: (start, [_lp_wire(t) for t in lp])
              for r, (start, lp) in o.prompt_logprobs.items()}
    return pack((o.req_ids, o.sampled_token_ids, lps, o.draft_token_ids, o.kv_finished,
                 o.kv_failed, prompt))


def _lp_wire(t: TokenLogprobs) -> tuple[list[int], list[float], int]:
    return t.token_ids, t.logprobs, t.sampled_rank


def decode_output(data: bytes) -> RunnerOutput:
    req_ids, sampled, lps, drafts, kv_finished, kv_failed, prompt = unpack(data)
    logprobs = [None] * len(req_ids) if lps is None else [
        None if lp is None else [TokenLogprobs(*t) for t in lp] for lp in lps]
    return RunnerOutput(req_ids, sampled, logprobs, drafts, kv_finished, kv_failed,
                        {r: (start, [TokenLogprobs(*t) for t in lp])
                         for r, (start, lp) in prompt.items()})
