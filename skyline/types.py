"""Plain data shared across layers. No torch here: these cross process and layer boundaries.

`SchedulerOutput` (scheduler -> worker) and `RunnerOutput` (worker -> scheduler) are the whole
contract between bookkeeping and compute. New requests are sent whole, known ones as diffs.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

INT64_LIMIT = 2**63  # integers the engine holds live in int64 (seeds: any 64-bit pattern)


def is_valid_unicode(text: str) -> bool:
    """Whether `text` encodes to UTF-8: JSON can spell lone UTF-16 surrogates ("\\ud800") that
    no tokenizer, msgpack or UTF-8 writer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    """How to sample one request's continuation (OpenAI / vLLM semantics)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages any token already in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once if the token was generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's and the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (llguidance, engine/frontend/structured.py); at most one of the three.
    json_schema: str | dict[str, Any] | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with one sentence naming the bad field. Every value that passes fits
        the types the engine holds it in (int64 tensors, 64-bit seeds, msgpack, UTF-8), so a
        request that passes cannot fail in the engine for its parameters."""
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and -INT64_LIMIT <= v < INT64_LIMIT):
                raise ValueError(f"{name} must be an integer below 2**63, got {v}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v}")
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be between 0 and 20, got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
            (self.seed is None or (isinstance(self.seed, int)
                                   and -INT64_LIMIT <= self.seed < 2 * INT64_LIMIT),
             f"seed must fit in 64 bits, got {self.seed}"),
            (all(isinstance(t, int) and 0 <= t < INT64_LIMIT for t in self.stop_token_ids),
             "stop_token_ids must be token ids (integers >= 0)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if sum(x is not None for x in (self.json_schema, self.regex, self.grammar)) > 1:
            raise ValueError("give at most one of json_schema, regex and grammar")
        for name, text in [*(("stop", s) for s in self.stop), ("regex", self.regex),
                           ("grammar", self.grammar)]:
            if text is not None and not is_valid_unicode(text):
                raise ValueError(f"{name} is not valid Unicode (it holds a lone surrogate such "
                                 "as \\ud800); send UTF-8 text")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids {bad[:8]} are outside the vocabulary (0..{vocab_size - 1})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # checked per request per step: identity tests (an enum's `.value` and `__hash__`
        # run Python code)
        return (self is RequestStatus.FINISHED_STOPPED or self is RequestStatus.FINISHED_LENGTH
                or self is RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """The scheduler's view of one sequence: token ids and counts, never tensors."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or scheduled to be)
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    max_model_len: int | None = None  # cap on prompt + output tokens
    # Tokens sampled by a step still in flight (async scheduling): scheduled, not yet known.
    num_output_placeholders: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


# ----------------------------------------------------------------------------------------
# scheduler -> worker


@dataclass
class NewRequestData:
    """A request the runner has not seen (or forgot after preemption): sent whole."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens in the KV cache before this step (prefix hits)


@dataclass
class CachedRequestData:
    """A request the runner knows: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # tokens in the KV cache before this step
    # Blocks dropped from the tail of its table since it last ran (slots of rejected draft
    # tokens); the runner drops them before appending `new_block_ids`.
    num_freed_blocks: int = 0


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req id -> tokens
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget before this step: finished, aborted or preempted.
    finished_request_ids: set[str] = field(default_factory=set)
    # Structured output: req id -> allowed-token bitmask for the token sampled this step
    # (little-endian int32 words, bit i of word j allows token 32 * j + i).
    token_masks: dict[str, bytes] = field(default_factory=dict)
    # Speculative decoding: req id -> draft tokens to verify. Such a request is scheduled
    # 1 + len(drafts) tokens: its last sampled token, then the drafts.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Whether the next step may verify drafts: if not, the runner only keeps its proposer's
    # state current after this step and drafts nothing (a plain stretch costs no drafting).
    propose_drafts: bool = True
    # Whether a hidden-state proposer (EAGLE) takes this step's rows into its cache: not while
    # the batch is past the static speculation bound (`SpecConfig.max_batch_tokens`), where no
    # step can verify drafts; it restarts its cache after such a stretch.
    feed_proposer: bool = True

    @property
    def empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# ----------------------------------------------------------------------------------------
# worker -> scheduler


@dataclass
class TokenLogprobs:
    """Logprobs at one position: index 0 is the sampled token, then the top-k by logprob."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the full distribution


@dataclass
class RunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    # One list per request in req_ids; empty while a prompt is still being prefilled in chunks.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # Speculative decoding: per request in req_ids, drafts proposed to follow its new tokens.
    # With drafts verified this step, sampled_token_ids holds the accepted drafts then one more.
    draft_token_ids: list[list[int]] = field(default_factory=list)


# ----------------------------------------------------------------------------------------
# engine core -> frontend


@dataclass(slots=True)  # one per request per step
class StepOutput:
    """What one engine step produced for one request (a diff)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ----------------------------------------------------------------------------------------
# frontend -> user


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
