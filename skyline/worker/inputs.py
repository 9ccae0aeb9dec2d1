"""Per-request state the runner keeps, and the flat input tensors of one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from skyline.model.forward_ctx import AttentionMetadata
from skyline.types import NewRequestData, SamplingParams
from skyline.worker.sampler import to_device


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    token_ids: list[int] = field(default_factory=list)  # prompt + output

    @classmethod
    def from_new(cls, new: NewRequestData) -> RequestState:
        s = cls(new.request_id, list(new.prompt_token_ids), list(new.output_token_ids),
                new.sampling_params, list(new.block_ids), new.num_computed_tokens)
        s.token_ids = s.prompt_token_ids + s.output_token_ids
        return s

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass
class StepInputs:
    req_ids: list[str]  # in batch order: one-token (decode) sequences first
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    # [num_logits] int64: the last real token of each sampling request, then its drafts
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]  # requests whose scheduled tokens reach their end


def build_inputs(
    states: dict[str, RequestState],
    num_scheduled: dict[str, int],
    block_size: int,
    device: torch.device,
    spec_token_ids: dict[str, list[int]] | None = None,
    in_flight: tuple[dict[str, int], torch.Tensor] | None = None,
) -> StepInputs:
    """Draft tokens of a request (`spec_token_ids`) follow its last real token in the batch; a
    request that reaches its end gets a logits row at its last real token and one per draft.

    `in_flight` (async scheduling): the previous step's sampled tokens, still on the device, and
    each sampling request's row in them. A request scheduled one token past what the host knows
    takes that token from there, without the host waiting for it."""
    spec = spec_token_ids or {}
    fill_at: list[int] = []  # positions in input_ids of tokens still on the device
    fill_from: list[int] = []  # their rows in the previous step's tokens
    # Decodes (one query token) first, so attention can batch them without per-sequence loops.
    req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
    num_decodes = sum(1 for r in req_ids if num_scheduled[r] == 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    logits_idx: list[int] = []
    sampling: list[str] = []
    max_blocks = 1
    for rid in req_ids:
        s = states[rid]
        n = num_scheduled[rid]
        start = s.num_computed_tokens
        end = start + n
        drafts = spec.get(rid, ())
        input_ids.extend(s.token_ids[start : end - len(drafts)])
        if end - len(drafts) > len(s.token_ids):
            assert in_flight is not None and end == len(s.token_ids) + 1 and not drafts, (
                f"request {rid} is scheduled past its known tokens with none in flight")
            fill_at.append(len(input_ids))
            fill_from.append(in_flight[0][rid])
            input_ids.append(0)
        input_ids.extend(drafts)
        pos = range(start, end)
        positions.extend(pos)
        blocks = s.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        qsl.append(qsl[-1] + n)
        seq_lens.append(end)
        max_blocks = max(max_blocks, len(blocks))
        if end - len(drafts) >= len(s.token_ids):
            logits_idx.extend(range(qsl[-1] - 1 - len(drafts), qsl[-1]))
            sampling.append(rid)
    rows = [states[rid].block_ids for rid in req_ids]
    table = torch.tensor([b + [0] * (max_blocks - len(b)) for b in rows], dtype=torch.int32)

    def t(x: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(x, dtype, device)

    attn = AttentionMetadata(
        slot_mapping=t(slots),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=table.pin_memory().to(device, non_blocking=True)
        if device.type == "cuda" else table,
        block_size=block_size,
        num_decodes=num_decodes,
        seq_lens_tensor=t(seq_lens, torch.int32),
        query_start_loc_tensor=t(qsl, torch.int32),
    )
    ids = t(input_ids)
    if fill_at:
        assert in_flight is not None
        ids[t(fill_at)] = in_flight[1][t(fill_from)]
    return StepInputs(req_ids, ids, t(positions), attn, t(logits_idx), sampling)
