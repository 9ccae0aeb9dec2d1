"""A request's sampling fields -> SamplingParams: the OpenAI ones, vLLM's extensions, logit
biases and the constraint on the output (response_format, `structured_outputs` or the older
`guided_*` fields: one of them), each checked with a 400 that names the field."""

from __future__ import annotations

from typing import Any

from skyline.engine.frontend.structured import check_structured
from skyline.server.errors import APIError
from skyline.server.protocol import SamplingRequest
from skyline.server.tool_parsers.base import lark_string
from skyline.types import SamplingParams

# SamplingParams field set by each kind of constraint
_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}


def _choice_grammar(choices: list[str], param: str) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise APIError(400, f"{param} must be a list of non-empty strings", param=param)
    return "start: " + " | ".join(lark_string(c) for c in choices) + "\n"


def constraint(req: SamplingRequest) -> tuple[str, str, Any] | None:
    """The request's one constraint on its output: (the field that gives it, the
    SamplingParams field it sets, its value), or None. Two at once are a 400."""
    found: list[tuple[str, str, Any]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_schema", {"type": "object"}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        found.append(("response_format", "json_schema", rf.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise APIError(400, "structured_outputs.structural_tag is not supported by this "
                                "server; use json, regex, choice or grammar",
                           param="structured_outputs")
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex),
                                     ("grammar", so.grammar)) if v is not None]
        found += [("structured_outputs", _KINDS[k], v) for k, v in given]
        if so.choice is not None:
            found.append(("structured_outputs", "grammar",
                          _choice_grammar(so.choice, "structured_outputs.choice")))
        if so.json_object:
            found.append(("structured_outputs", "json_schema", {"type": "object"}))
    for param, kind, value in (("guided_json", "json_schema", req.guided_json),
                               ("guided_regex", "regex", req.guided_regex),
                               ("guided_grammar", "grammar", req.guided_grammar)):
        if value is not None:
            found.append((param, kind, value))
    if req.guided_choice is not None:
        found.append(("guided_choice", "grammar",
                      _choice_grammar(req.guided_choice, "guided_choice")))
    if len(found) > 1:
        names = sorted({f[0] for f in found})
        raise APIError(400, f"give one constraint on the output, not {len(found)} (from "
                            f"{', '.join(names)})", param=found[1][0])
    return found[0] if found else None


def build_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                 vocab_size: int) -> tuple[SamplingParams, str | None]:
    """The request's SamplingParams, validated (a 400 names the bad field) before the prompt
    costs anything, and the field that gave its constraint on the output, if any (the
    constraint is checked by `check_constraint`, off the event loop)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    # keys are digit strings (limits.check_sampling)
    bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
    params = SamplingParams(
        n=req.n, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0),
        top_k=pick(req.top_k, 0), min_p=pick(req.min_p, 0.0),
        repetition_penalty=pick(req.repetition_penalty, 1.0),
        presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0),
        seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=req.prompt_logprobs, logit_bias=bias,
        kv_transfer_params=(req.kv_transfer_params.model_dump()
                            if req.kv_transfer_params is not None else None),
    )
    found = constraint(req)
    if found is not None:
        setattr(params, found[1], found[2])
    try:
        params.validate(vocab_size)
    except ValueError as e:
        param = "logit_bias" if "logit_bias" in str(e) else None
        raise APIError(400, str(e), param=param) from None
    return params, found[0] if found is not None else None


def check_constraint(params: SamplingParams, param: str | None) -> None:
    """Compile the output's constraint with llguidance (blocking: a preparation thread); a
    grammar, regex or schema it cannot use is a 400 naming `param`, the field that gave it."""
    try:
        check_structured(params)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}" if param else str(e), param=param) from None
