"""What one request may cost, and the checks that hold a parsed request to it.

Each limit has a `skyline serve` flag. The checks are pure functions of the parsed body: they
run wherever the body is parsed (on the event loop for small bodies, in a parse worker for large
ones), before anything is tokenized or queued.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import pydantic

from skyline.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionTool,
    SamplingRequest,
)

# Each message costs the prompt at least its role header ("<|im_start|>user\n...<|im_end|>\n"
# and the like), so a flood of empty messages counts against the prompt's characters too.
MESSAGE_OVERHEAD_CHARS = 16
# Characters per token beyond which no tokenizer in use goes on real text: the default prompt
# limit, as a multiple of the context length (a longer prompt could never fit anyway).
CHARS_PER_TOKEN_BOUND = 32
# chat_template_kwargs keys that would overwrite what the server itself gives the template.
RESERVED_TEMPLATE_KEYS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
    "unk_token", "pad_token", "raise_exception", "strftime_now",
})


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; 0 in max_prompt_chars means CHARS_PER_TOKEN_BOUND x the context."""

    max_body_bytes: int = 16 << 20
    max_prompt_chars: int = 0
    max_n: int = 128  # choices per request (n, times the prompts of a batched completion)
    max_stop: int = 32  # stop strings, and stop token ids
    max_stop_chars: int = 1000  # characters per stop string
    max_logprobs: int = 20
    max_tools: int = 128  # tools offered, and calls in one past assistant message
    # a response_format schema, a structured-output constraint, or one tool, as JSON
    max_schema_bytes: int = 64 << 10
    max_logit_bias: int = 300  # tokens a logit_bias names
    prepare_timeout_s: float = 10.0  # parse + chat template + tokenize
    body_timeout_s: float = 30.0  # for the whole body to arrive
    max_token_ids: int = 0  # in a prompt or a /detokenize call; 0: the context length

    def resolved(self, max_model_len: int) -> RequestLimits:
        """The limits with their automatic values filled in for a model's context length."""
        chars = self.max_prompt_chars or max(1 << 20, CHARS_PER_TOKEN_BOUND * max_model_len)
        return dataclasses.replace(self, max_prompt_chars=chars,
                                   max_token_ids=self.max_token_ids or max_model_len)


class LimitError(ValueError):
    """A request over one of the limits (a 400): the message says which and what to send."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def check_sampling(req: SamplingRequest, limits: RequestLimits, num_prompts: int = 1) -> None:
    choices = req.n * num_prompts
    if choices > limits.max_n:
        what = f"n={req.n}" if num_prompts == 1 else f"n={req.n} for {num_prompts} prompts"
        raise LimitError(f"{what} asks for {choices} choices; this server allows at most "
                         f"{limits.max_n} per request", "n")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > limits.max_stop:
        raise LimitError(f"stop has {len(stop)} strings; this server allows at most "
                         f"{limits.max_stop}", "stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise LimitError(f"a stop string is longer than {limits.max_stop_chars} characters; "
                         "send shorter ones", "stop")
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop:
        raise LimitError(f"stop_token_ids has {len(req.stop_token_ids)} ids; this server allows "
                         f"at most {limits.max_stop}", "stop_token_ids")
    if (req.prompt_logprobs or 0) > limits.max_logprobs:
        raise LimitError(f"prompt_logprobs is {req.prompt_logprobs}; this server allows at most "
                         f"{limits.max_logprobs}", "prompt_logprobs")
    bias = req.logit_bias or {}
    if len(bias) > limits.max_logit_bias:
        raise LimitError(f"logit_bias names {len(bias)} tokens; this server allows at most "
                         f"{limits.max_logit_bias}", "logit_bias")
    if any(not (k.isascii() and k.isdigit() and len(k) <= 19) for k in bias):
        raise LimitError("logit_bias keys must be token ids (e.g. \"1234\")", "logit_bias")
    rf = req.response_format
    for param, value in (
            ("response_format", rf.json_schema.schema_ if rf and rf.json_schema else None),
            ("structured_outputs", req.structured_outputs.model_dump(exclude_none=True)
             if req.structured_outputs else None),
            ("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice), ("guided_grammar", req.guided_grammar)):
        if value is not None and _json_bytes(value) > limits.max_schema_bytes:
            raise LimitError(f"{param} is larger than {limits.max_schema_bytes} bytes as JSON; "
                             "send a smaller one", param)


def check_chat(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    check_sampling(req, limits)
    if req.logprobs and (req.top_logprobs or 0) > limits.max_logprobs:
        raise LimitError(f"top_logprobs is {req.top_logprobs}; this server allows at most "
                         f"{limits.max_logprobs}", "top_logprobs")
    tools = req.tools or []
    if len(tools) > limits.max_tools:
        raise LimitError(f"tools has {len(tools)} entries; this server allows at most "
                         f"{limits.max_tools}", "tools")
    if any(_json_bytes(t) > limits.max_schema_bytes for t in tools):
        raise LimitError(f"a tool is larger than {limits.max_schema_bytes} bytes as JSON; send "
                         "smaller ones", "tools")
    for i, t in enumerate(tools):
        try:
            FunctionTool.model_validate(t)
        except pydantic.ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = ".".join(str(x) for x in err["loc"])
            raise LimitError(f"tools[{i}] is not a function tool ({where}: {err['msg']}); send "
                             '{"type": "function", "function": {"name": ..., "parameters": '
                             "{...}}}", "tools") from None
    check_tool_choice(req.tool_choice, {t["function"]["name"] for t in tools})
    for m in req.messages:
        if m.tool_calls and len(m.tool_calls) > limits.max_tools:
            raise LimitError(f"a message holds {len(m.tool_calls)} tool calls; this server "
                             f"allows at most {limits.max_tools}", "messages")
    kwargs = req.chat_template_kwargs or {}
    if "chat_template" in kwargs:
        raise LimitError("chat_template_kwargs.chat_template is not accepted: the chat template "
                         "comes from the model or the server's --chat-template",
                         "chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KEYS & kwargs.keys())
    if reserved:
        raise LimitError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server "
                         "sets them", "chat_template_kwargs")
    chars = sum(_message_chars(m) for m in req.messages) + _json_bytes(kwargs)
    if chars > limits.max_prompt_chars:
        raise LimitError(f"the messages hold about {chars} characters; this server allows "
                         f"{limits.max_prompt_chars} per prompt (shorten the conversation)",
                         "messages")


def check_tool_choice(choice: Any, names: set[str]) -> None:
    """tool_choice is "none", "auto", "required" or {"type": "function", "function": {"name":
    one of the tools}}; the last two need tools."""
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not names:
            raise LimitError("tool_choice 'required' needs tools", "tool_choice")
        return
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise LimitError('tool_choice must be "none", "auto", "required" or {"type": '
                         '"function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise LimitError(f"tool_choice names the function {name[:64]!r}, which is not among "
                         "the tools", "tool_choice")


def check_completion(req: CompletionRequest, limits: RequestLimits) -> None:
    prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    num = len(prompts) if prompts and not isinstance(prompts[0], int) else 1
    check_sampling(req, limits, num)
    if req.logprobs is not None and req.logprobs > limits.max_logprobs:
        raise LimitError(f"logprobs is {req.logprobs}; this server allows at most "
                         f"{limits.max_logprobs}", "logprobs")
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    for p in prompts:
        if isinstance(p, str) and len(p) > limits.max_prompt_chars:
            raise LimitError(f"a prompt holds {len(p)} characters; this server allows "
                             f"{limits.max_prompt_chars} (shorten it)", "prompt")
        if isinstance(p, list) and len(p) > limits.max_token_ids:
            raise LimitError(f"a prompt holds {len(p)} token ids, more than the context length "
                             f"({limits.max_token_ids}); shorten it", "prompt")


def check_detokenize(tokens: list[int], limits: RequestLimits) -> None:
    if len(tokens) > limits.max_token_ids:
        raise LimitError(f"tokens holds {len(tokens)} ids; this server detokenizes at most "
                         f"{limits.max_token_ids} (its context length) at once", "tokens")


def check_prompt_chars(text: str, limits: RequestLimits, param: str = "prompt") -> None:
    if len(text) > limits.max_prompt_chars:
        raise LimitError(f"the prompt holds {len(text)} characters; this server allows "
                         f"{limits.max_prompt_chars} (shorten it)", param)


def _message_chars(m: ChatMessage) -> int:
    content = m.content
    if isinstance(content, list):
        n = sum(len(p.text or "") for p in content)
    else:
        n = len(content or "")
    calls = sum(len(c.function.name) + len(c.function.arguments) + MESSAGE_OVERHEAD_CHARS
                for c in m.tool_calls or ())
    return n + len(m.name or "") + len(m.tool_call_id or "") + calls + MESSAGE_OVERHEAD_CHARS
