"""Appending a step's tokens to a request: the stop checks run on every token, and the step's
output for the request (with its prompt logprobs, received as the prefill's chunks run)."""

from __future__ import annotations

from skyline.types import Request, RequestStatus, StepOutput, TokenLogprobs


def append_until_stop(req: Request, token_ids: list[int], max_len: int) -> list[int]:
    """Append tokens to the request's output until one ends it; returns those appended."""
    new_ids: list[int] = []
    for token_id in token_ids:
        req.append_output_token(token_id)
        new_ids.append(token_id)
        if check_stop(req, token_id, max_len):
            break
    return new_ids


def step_output(req: Request, new_ids: list[int], logprobs: list[list[TokenLogprobs] | None],
                i: int | None) -> StepOutput:
    """The request's StepOutput for tokens just appended (row `i` of the runner's logprobs),
    with its finish reason if they ended it."""
    lps = logprobs[i] if i is not None and i < len(logprobs) else None
    out = StepOutput(request_id=req.request_id, new_token_ids=new_ids,
                     new_logprobs=trim_logprobs(lps, len(new_ids)),
                     num_prompt_tokens=req.num_prompt_tokens,
                     num_cached_tokens=max(req.num_cached_tokens, 0))
    if (req.sampling_params.prompt_logprobs is not None and new_ids
            and req.num_output_tokens == len(new_ids)):  # the first tokens: the prompt is done
        out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
    if req.status.finished:
        out.finish_reason = req.status.value
        out.stop_reason = req.stop_reason
    return out


def check_stop(req: Request, token_id: int, max_len: int) -> bool:
    """Set the request's finished status if `token_id` (just appended) ends it; `max_len` is
    the most tokens (prompt and output) the request may hold."""
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED  # stop_reason stays None for eos
            return True
        if token_id in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token_id
            return True
    if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
        req.status = RequestStatus.FINISHED_LENGTH
        return True
    if req.num_tokens >= max_len:
        req.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def trim_logprobs(logprobs: list[TokenLogprobs] | None, n: int) -> list[TokenLogprobs] | None:
    """The logprobs of the first `n` positions (those of tokens emitted before a stop)."""
    return None if logprobs is None else logprobs[:n]


def scores_prompt(req: Request) -> bool:
    """Whether the request still needs logprobs of prompt tokens (which a prefix-cache hit
    would skip)."""
    return (req.sampling_params.prompt_logprobs is not None
            and req.num_prompt_logprobs < req.num_prompt_tokens - 1)


def receive_prompt_logprobs(req: Request, first: int, lps: list[TokenLogprobs]) -> None:
    """Keep the prompt logprobs of tokens `first`, `first` + 1, ... that are new: a prefill
    recomputed after preemption scores tokens again."""
    skip = req.num_prompt_logprobs + 1 - first
    if 0 <= skip < len(lps):
        req.prompt_logprobs.extend(lps[skip:])
        req.num_prompt_logprobs += len(lps) - skip
