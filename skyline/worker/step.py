"""A launched step, part by part, until its tokens are read back.

A step runs as one part, or, with pipeline stages, as micro-batches: its requests split into
as many parts as there are stages, of about equal tokens (decodes first, as the batch is laid
out), so that stage s + 1 runs part j while stage s runs part j + 1. The scheduler does not
change: it schedules one batch per step and the runner splits it. (The other way, two
schedules in flight, needs a scheduler that keeps two disjoint batches and their KV blocks
apart; a split step needs nothing of it.) With async scheduling the parts of step n + 1 follow
those of step n without draining the pipeline: a part waits only for the tokens of its own
requests, and those come from step n's part of the same requests.

Where the tokens of a part are: on the sampling rank (the driver) in its draw (`sample`), or
already on the host (`result`: verified drafts, constrained rows); on the other ranks that
embed tokens (the first stage), in a broadcast from the driver (`tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from skyline.parallel.groups import Pending
from skyline.types import TokenLogprobs
from skyline.worker.inputs import RequestState
from skyline.worker.sampler import DeviceSample


@dataclass
class Part:
    req_ids: list[str]
    sampling_req_ids: list[str]  # requests whose scheduled tokens reach their end
    sample: DeviceSample | None = None
    result: tuple[dict[str, list[int]], dict[str, list[TokenLogprobs] | None]] | None = None
    tokens: Pending | None = None
    transfers: list[Pending] = field(default_factory=list)  # kept alive until done

    def device_tokens(self) -> torch.Tensor | None:
        """The part's sampled tokens [num sampling] on the device, once known there (a CUDA
        broadcast is ordered before the stream's next kernels; the host does not wait)."""
        if self.sample is not None:
            return self.sample.tokens
        return self.tokens.wait() if self.tokens is not None else None


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    parts: list[Part] = field(default_factory=list)
    propose: bool = True  # draft for the next step (SchedulerOutput.propose_drafts)
    # SamplingParams.prompt_logprobs: the driver's, of every part (RunnerOutput.prompt_logprobs)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    _rows: dict[str, tuple[int, int]] | None = None  # request -> (part, row), made on demand

    def add_prompt_logprobs(self, lps: dict[str, tuple[int, list[TokenLogprobs]]] | None
                            ) -> None:
        if lps:
            self.prompt_logprobs = {**(self.prompt_logprobs or {}), **lps}

    @property
    def req_ids(self) -> list[str]:
        if len(self.parts) == 1:
            return self.parts[0].req_ids
        return [r for p in self.parts for r in p.req_ids]

    def tokens_for(self, states: dict[str, RequestState], scheduled: dict[str, int]
                   ) -> tuple[dict[str, int], torch.Tensor] | None:
        """For `build_inputs`: each request's row in the tokens (on the device) it needs from
        this step, and those tokens; None where there are none."""
        if not self.parts:  # a step of KV transfers only
            return None
        if len(self.parts) == 1:
            part = self.parts[0]
            tokens = part.device_tokens() if part.result is None else None
            if tokens is None:
                return None
            return {r: i for i, r in enumerate(part.sampling_req_ids)}, tokens
        if self._rows is None:
            self._rows = {r: (j, i) for j, p in enumerate(self.parts)
                          for i, r in enumerate(p.sampling_req_ids)}
        needed = sorted({self._rows[r][0] for r, n in scheduled.items()
                         if states[r].num_computed_tokens + n > len(states[r].token_ids)})
        if not needed:
            return None
        offsets, chunks, total = {}, [], 0
        for j in needed:
            offsets[j] = total
            t = self.parts[j].device_tokens()
            assert t is not None, "a request lacks its previous token"
            chunks.append(t)
            total += t.shape[0]
        rows = {r: offsets[j] + i for r, (j, i) in self._rows.items() if j in offsets}
        return rows, chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def split_parts(num_scheduled: dict[str, int], num_parts: int) -> list[dict[str, int]]:
    """The step's requests in `num_parts` parts (fewer if there are fewer requests) of about
    equal tokens, in batch order (one-token requests first). Every rank splits alike."""
    if num_parts == 1 or len(num_scheduled) == 1:
        return [num_scheduled]
    order = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
    num_parts = min(num_parts, len(order))
    total = sum(num_scheduled.values())
    parts: list[dict[str, int]] = [{}]
    done = 0
    for i, rid in enumerate(order):
        left = len(order) - i  # requests not placed yet, this one included
        if parts[-1] and len(parts) < num_parts and (
                done >= total * len(parts) / num_parts or left == num_parts - len(parts)):
            parts.append({})
        parts[-1][rid] = num_scheduled[rid]
        done += num_scheduled[rid]
    return parts
