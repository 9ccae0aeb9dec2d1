"""POST /tokenize and /detokenize (vLLM's extensions): the same parsing, limits and preparation
threads as the completion routes."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from skyline.server.chat import render_chat
from skyline.server.errors import APIError
from skyline.server.limits import LimitError, check_prompt_chars
from skyline.server.protocol import DetokenizeRequest, TokenizeRequest
from skyline.server.serving import ServerState, encode_text


async def tokenize(state: ServerState, raw: Request) -> dict[str, Any]:
    parsed, deadline = await state.parse("tokenize", raw)
    req: TokenizeRequest = parsed.request
    state.check_model(req.model)
    tok = state.llm.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    if parsed.messages is not None:
        messages = parsed.messages
        _, ids = await state.in_thread(deadline, lambda: render_chat(
            state, messages, req.add_generation_prompt, None, deadline))
    elif req.prompt is not None:
        prompt = req.prompt
        try:
            check_prompt_chars(prompt, state.limits)
        except LimitError as e:
            raise APIError(400, str(e), param=e.param) from None
        ids = await state.in_thread(deadline, lambda: encode_text(tok, prompt,
                                                                  req.add_special_tokens))
    else:
        raise APIError(400, "give either 'prompt' or 'messages'")
    return {"count": len(ids), "max_model_len": state.llm.max_model_len, "tokens": ids}


async def detokenize(state: ServerState, raw: Request) -> dict[str, Any]:
    parsed, deadline = await state.parse("detokenize", raw)
    req: DetokenizeRequest = parsed.request
    state.check_model(req.model)
    tok = state.llm.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    vocab = state.llm.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens must be in 0..{vocab - 1}", param="tokens")
    tokens = req.tokens
    text = await state.in_thread(deadline, lambda: tok.decode(tokens))
    return {"prompt": text}
