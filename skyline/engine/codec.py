"""Messages between the API processes and the engine core (engine/process.py): msgpack, with
the dataclasses turned into plain lists and dicts by the explicit helpers here, not pickle."""

from __future__ import annotations

import dataclasses
from typing import Any

from skyline.types import Request, SamplingParams, StepOutput, TokenLogprobs

# The same msgpack settings as the engine's messages to its ranks (bytes stay bytes, str stays
# str, any map key): one definition.
from skyline.worker.executor.codec import pack as pack
from skyline.worker.executor.codec import unpack as unpack


def params_to_dict(p: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


def request_to_dict(r: Request) -> dict[str, Any]:
    return {"id": r.request_id, "prompt": r.prompt_token_ids,
            "params": params_to_dict(r.sampling_params), "eos": list(r.eos_token_ids)}


def request_from_dict(d: dict[str, Any]) -> Request:
    return Request(d["id"], d["prompt"], params_from_dict(d["params"]),
                   eos_token_ids=tuple(d["eos"]))


def _logprobs_to_list(lps: list[TokenLogprobs] | None) -> list[Any] | None:
    return None if lps is None else [[t.token_ids, t.logprobs, t.sampled_rank] for t in lps]


def _logprobs_from_list(v: list[Any] | None) -> list[TokenLogprobs] | None:
    return None if v is None else [TokenLogprobs(a, b, c) for a, b, c in v]


def step_output_to_list(o: StepOutput) -> list[Any]:
    return [o.request_id, o.new_token_ids, _logprobs_to_list(o.new_logprobs), o.finish_reason,
            o.stop_reason, o.num_prompt_tokens, o.num_cached_tokens,
            _logprobs_to_list(o.prompt_logprobs)]


def step_output_from_list(v: list[Any]) -> StepOutput:
    rid, ids, lps, finish, stop, num_prompt, num_cached, prompt_lps = v
    return StepOutput(rid, ids, _logprobs_from_list(lps), finish, stop, num_prompt, num_cached,
                      _logprobs_from_list(prompt_lps))
