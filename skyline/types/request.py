"""A request and how to sample it: what a user sends, as every layer sees it."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

INT64_LIMIT = 2**63  # integers the engine holds live in int64 (seeds: any 64-bit pattern)
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI allows
MAX_LOGIT_BIAS = 100  # OpenAI's range for a logit bias


def is_valid_unicode(text: str) -> bool:
    """Whether `text` encodes to UTF-8: JSON can spell lone UTF-16 surrogates ("\\ud800") that
    no tokenizer, msgpack or UTF-8 writer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class TokenLogprobs:
    """Logprobs at one position: index 0 is the sampled token, then the top-k by logprob."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the full distribution


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
    # None: none; k >= 0: each prompt token's logprob (given the tokens before it) and the top
    # k there, from the prefill pass (such a request reuses no cached prefix: it is scored)
    prompt_logprobs: int | None = None
    # token id -> added to its logit before sampling (OpenAI: -100 bans, +100 forces)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (llguidance, engine/frontend/structured.py); at most one of the three.
    json_schema: str | dict[str, Any] | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar
    # Prefill/decode disaggregation (cache/pd.py): {"transfer_id", "do_remote_decode", "peer"}
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with one sentence naming the bad field. Every value that passes fits
        the types the engine holds it in (int64 tensors, 64-bit seeds, msgpack, UTF-8), so a
        request that passes cannot fail in the engine for its parameters."""
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
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
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}"),
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
        self._validate_logit_bias()
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids {bad[:8]} are outside the vocabulary (0..{vocab_size - 1})"
                )
            bad = [t for t in self.logit_bias or () if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias has token ids {bad[:8]} outside the vocabulary "
                                 f"(0..{vocab_size - 1})")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to biases")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or not 0 <= t < INT64_LIMIT:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if (not isinstance(b, int | float) or not math.isfinite(b)
                    or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be between -{MAX_LOGIT_BIAS} and "
                                 f"{MAX_LOGIT_BIAS}, got {b!r} for token {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Holds blocks that a KV connector is filling (from a lower tier or another replica); it
    # joins the running batch when they are in (sched/kv_loads.py).
    WAITING_FOR_KV = "waiting_for_kv"
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
    # Prompt logprobs (SamplingParams.prompt_logprobs): those received from the runner for
    # prompt tokens 1, 2, ... and not yet handed out (a recomputed prefill repeats some)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_logprobs: int = 0  # prompt tokens whose logprobs were received

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
