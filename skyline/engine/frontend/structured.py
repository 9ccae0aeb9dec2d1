"""Structured output with llguidance: JSON schemas, regexes and Lark grammars as token masks.

The frontend checks a request's grammar (`check_structured`) so that a bad schema is a clear
error before anything is queued. The engine core keeps one `LLMatcher` per constrained request
(`StructuredOutputs`): before each step it puts the allowed-token bitmask of every constrained
request that samples into `SchedulerOutput.token_masks`, and after the step it advances the
matchers with the sampled tokens. The runner applies the masks to the logits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from skyline.config import ModelConfig
from skyline.types import RunnerOutput, SamplingParams, SchedulerOutput

log = logging.getLogger(__name__)

# Compact, deterministic JSON layout: a small model cannot wander off into endless whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_for(params: SamplingParams) -> str | None:
    """The llguidance grammar (JSON text) a request's output must match, or None."""
    if not constrained(params):
        return None
    import llguidance

    if params.json_schema is not None:
        schema: Any = params.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)
    return None


def check_structured(params: SamplingParams) -> None:
    """Raise ValueError with one sentence if the request's schema or grammar is unusable."""
    grammar = grammar_for(params)
    if grammar is None:
        return
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as e:  # llguidance raises on grammars it cannot even parse
        is_error, messages = True, [str(e)]
    if is_error:
        what = "json_schema" if params.json_schema is not None else (
            "regex" if params.regex is not None else "grammar")
        detail = " ".join((messages[0] if messages else "invalid").split())
        raise ValueError(f"the {what} cannot be used for constrained decoding: {detail}")


def make_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """An llguidance tokenizer over the model's vocabulary (rows beyond the tokenizer's own
    vocabulary are never allowed)."""
    import llguidance

    backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "tok", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise ValueError("structured output needs a Hugging Face `tokenizers` tokenizer")
    eos: int | list[int] | None = list(eos_token_ids) if eos_token_ids else None
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


class StructuredOutputs:
    """Per-request grammar matchers in the engine core: masks before a step, advance after."""

    def __init__(self, ll_tokenizer: Callable[[], Any], eos_token_ids: tuple[int, ...],
                 vocab_size: int) -> None:
        self._make_tokenizer = ll_tokenizer
        self._tokenizer: Any = None
        self._tokenizer_error: str | None = None
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.matchers: dict[str, Any] = {}
        self.num_tokens: dict[str, int] = {}  # prompt + tokens consumed by the matcher

    @property
    def tokenizer(self) -> Any:
        """llguidance's view of the model's tokenizer (ValueError, with one sentence, when it
        cannot read it: every constrained request is then refused)."""
        if self._tokenizer is None:
            if self._tokenizer_error is None:
                try:
                    self._tokenizer = self._make_tokenizer()  # ~1 s once: built on first use
                except Exception as e:  # llguidance raises on tokenizers it cannot read
                    self._tokenizer_error = (f"this model's tokenizer cannot be used for "
                                             f"constrained decoding ({' '.join(str(e).split())})")
            if self._tokenizer_error is not None:
                raise ValueError(self._tokenizer_error)
            self.eos_token_ids = tuple(self._tokenizer.eos_tokens) or self.eos_token_ids
        return self._tokenizer

    def admit(self, params: SamplingParams) -> None:
        """Raise ValueError if a constrained request cannot be served (the tokenizer)."""
        if constrained(params):
            _ = self.tokenizer

    def _add(self, rid: str, params: SamplingParams, num_prompt: int, outputs: list[int]) -> None:
        import llguidance

        try:
            grammar = grammar_for(params)
            m: Any = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            m.consume_tokens(outputs)  # a request resumed after preemption
        except Exception as e:  # the frontend checks grammars; never let one stop the engine
            log.warning("request %s: unusable grammar: %s", rid, e)
            m = None
        self.matchers[rid] = m
        self.num_tokens[rid] = num_prompt + len(outputs)

    def before_step(self, out: SchedulerOutput) -> None:
        """Forget finished requests, adopt new ones and fill `out.token_masks`."""
        for rid in out.finished_request_ids:
            self.matchers.pop(rid, None)
            self.num_tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for new in out.new_requests:
            if constrained(new.sampling_params):
                self._add(new.request_id, new.sampling_params, len(new.prompt_token_ids),
                          new.output_token_ids)
            computed[new.request_id] = new.num_computed_tokens
        if not self.matchers:
            return
        for c in out.cached_requests:
            computed[c.request_id] = c.num_computed_tokens
        for rid, m in self.matchers.items():
            num = out.num_scheduled_tokens.get(rid)
            if num is None or computed.get(rid, 0) + num < self.num_tokens[rid]:
                continue  # not scheduled, or a prefill chunk that samples nothing
            out.token_masks[rid] = self._mask(rid, m)

    def _mask(self, rid: str, m: Any) -> bytes:
        if m is not None and not m.is_error():
            return m.compute_bitmask()
        # A matcher in error (an unusable grammar, which `check_structured` should have caught)
        # allows only end-of-sequence, so that the request ends instead of running unconstrained.
        if m is not None:
            log.warning("request %s: structured output failed: %s", rid, m.get_error())
        words = bytearray((self.vocab_size + 31) // 32 * 4)
        for t in self.eos_token_ids:
            if t // 8 < len(words):
                words[t // 8] |= 1 << (t % 8)
        return bytes(words)

    def after_step(self, out: SchedulerOutput, res: RunnerOutput) -> None:
        """Advance each constrained request's matcher with the tokens it sampled."""
        if not self.matchers:
            return
        for rid, tokens in zip(res.req_ids, res.sampled_token_ids, strict=False):
            if rid not in self.matchers or not tokens:
                continue
            m = self.matchers[rid]
            if m is not None:
                m.consume_tokens(tokens)
            self.num_tokens[rid] += len(tokens)


def constrained(params: SamplingParams) -> bool:
    return params.json_schema is not None or params.regex is not None or params.grammar is not None


def structured_outputs(model: ModelConfig, load_tokenizer: Callable[[], Any]
                       ) -> StructuredOutputs:
    """The structured-output hooks an EngineCore's scheduler runs each step; the tokenizer
    (and llguidance's view of it) is built on the first constrained request."""
    eos = model.arch.eos_token_ids

    def ll_tokenizer() -> Any:
        tok = load_tokenizer()
        ids = tuple(tok.eos_token_ids) if tok is not None and tok.eos_token_ids else eos
        return make_ll_tokenizer(tok, model.arch.vocab_size, ids)

    return StructuredOutputs(ll_tokenizer, eos, model.arch.vocab_size)
