"""Per-request state the runner keeps, and the flat input tensors of one step."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from skyline.model.forward_ctx import AttentionMetadata
from skyline.types import NewRequestData, SamplingParams
from skyline.worker.sampler import SamplingRow, to_device


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: array  # int32 ('i'): a step joins every request's ids without a loop over them
    num_computed_tokens: int
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    sampling_row: SamplingRow | None = None  # the sampler's view, made at its first sample

    def __post_init__(self) -> None:
        if not isinstance(self.block_ids, array):
            self.block_ids = array("i", self.block_ids)

    @classmethod
    def from_new(cls, new: NewRequestData) -> RequestState:
        s = cls(new.request_id, list(new.prompt_token_ids), list(new.output_token_ids),
                new.sampling_params, new.block_ids, new.num_computed_tokens)
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
    with_ids: bool = True,
) -> StepInputs:
    """Draft tokens of a request (`spec_token_ids`) follow its last real token in the batch; a
    request that reaches its end gets a logits row at its last real token and one per draft.

    `in_flight` (async scheduling): the previous step's sampled tokens, still on the device, and
    each sampling request's row in them. A request scheduled one token past what the host knows
    takes that token from there, without the host waiting for it.

    Without `with_ids` (a later pipeline stage, whose input is the previous stage's hidden
    states) no token ids are gathered; `input_ids` is left empty.

    At a thousand requests this runs every step of a decode-bound batch, so the per-request
    loop only gathers token ids and counts; positions, slots and the block table are built
    with whole-array operations."""
    spec = spec_token_ids or {}
    fill_at: list[int] = []  # positions in input_ids of tokens still on the device
    fill_from: list[int] = []  # their rows in the previous step's tokens
    # Decodes (one query token) first, so attention can batch them without per-sequence loops.
    req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
    batch = [states[rid] for rid in req_ids]
    counts = [num_scheduled[rid] for rid in req_ids]
    flat_blocks = array("i")  # every block table, end to end
    num_blocks: list[int] = []
    input_ids: list[int] = []
    logits_idx: list[int] = []
    sampling: list[str] = []
    starts: list[int] = []
    end_of_batch = 0
    for rid, s, n in zip(req_ids, batch, counts, strict=True):
        start = s.num_computed_tokens
        starts.append(start)
        end = start + n
        end_of_batch += n
        flat_blocks += s.block_ids
        num_blocks.append(len(s.block_ids))
        drafts = spec.get(rid, ())
        known = len(s.token_ids)
        if with_ids:
            input_ids.extend(s.token_ids[start : end - len(drafts)])
            if end - len(drafts) > known:
                assert in_flight is not None and end == known + 1 and not drafts, (
                    f"request {rid} is scheduled past its known tokens with none in flight")
                fill_at.append(len(input_ids))
                fill_from.append(in_flight[0][rid])
                input_ids.append(0)
            if drafts:
                input_ids.extend(drafts)
        if end - len(drafts) >= known:
            logits_idx.extend(range(end_of_batch - 1 - len(drafts), end_of_batch))
            sampling.append(rid)
    lens = np.array(num_blocks, dtype=np.int64)
    table = np.zeros((len(batch), lens.max(initial=1)), dtype=np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.frombuffer(flat_blocks, np.int32)
    n_tok = np.array(counts, dtype=np.int64)
    first = np.array(starts, dtype=np.int64)
    qsl = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(n_tok, out=qsl[1:])
    seq_lens = first + n_tok
    # token t of sequence i sits at position first[i] + (t - qsl[i])
    seq_of_token = np.repeat(np.arange(len(batch)), n_tok)
    positions = np.arange(qsl[-1]) + np.repeat(first - qsl[:-1], n_tok)
    slots = table[seq_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size

    def t(x: list[int] | np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(x, dtype, device)

    attn = AttentionMetadata(
        slot_mapping=t(slots),
        query_start_loc=qsl.tolist(),
        seq_lens=seq_lens.tolist(),
        block_tables=t(table, torch.int32),
        block_size=block_size,
        num_decodes=sum(1 for n in counts if n == 1),
        seq_lens_tensor=t(seq_lens, torch.int32),
        query_start_loc_tensor=t(qsl, torch.int32),
    )
    ids = t(input_ids)
    if fill_at:
        assert in_flight is not None
        ids[t(fill_at)] = in_flight[1][t(fill_from)]
    return StepInputs(req_ids, ids, t(positions), attn, t(logits_idx), sampling)
