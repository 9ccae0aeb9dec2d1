"""The messages of one engine step: scheduler -> worker (`SchedulerOutput`), worker ->
scheduler (`RunnerOutput`), engine core -> front end (`StepOutput`) and front end -> user
(`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyline.types.request import Request, SamplingParams, TokenLogprobs

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

    @classmethod
    def of(cls, req: Request, block_ids: list[int]) -> NewRequestData:
        return cls(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                   req.sampling_params, block_ids, req.num_computed_tokens)


@dataclass
class CachedRequestData:
    """A request the runner knows: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # tokens in the KV cache before this step
    # Blocks dropped from the tail of its table since it last ran (slots of rejected draft
    # tokens); the runner drops them before appending `new_block_ids`.
    num_freed_blocks: int = 0


KV_LOAD, KV_STORE, KV_SPILL, KV_DROP = "load", "store", "spill", "drop"
# Prefill/decode: a finished request's blocks, held for a peer to pull (cache/pd.py)
KV_SEND = "send"


@dataclass
class KVTransfer:
    """Block copies between the device's KV cache and what lies beyond it (host RAM, disk, a
    peer), decided by the scheduler's half of the KV connector (cache/connector.py) and run by
    every rank's worker on its own shard of each block (worker/connector/). The worker reports
    it by `op_id` once all its copies ended (`RunnerOutput.kv_finished` / `kv_failed`).

    Per block i, with `keys[i]` its chained hash:
    - load: fill device block `block_ids[i]` of request `request_id`, from host-RAM slot
      `ram_slots[i]`, or from disk where `disk[i]`;
    - store: copy device block `block_ids[i]` (full and computed: its KV is final) into RAM
      slot `ram_slots[i]`, and where `disk[i]` on to disk. Ordered before any later step
      writes into the block, so the pool may hand it out again at once;
    - spill: write RAM slot `ram_slots[i]` to disk (`block_ids` empty);
    - drop: delete the disk copy of each key (`block_ids`, `ram_slots` empty).
    - send: hold the device blocks `block_ids` (of a finished request) for a peer that pulls
      them by key (prefill/decode: `params` {"transfer_id", "ttl_s"}); it ends once pulled,
      or after ttl_s.
    `params`: a transport's own parameters (a peer to pull from), None for the local tiers."""

    op_id: int
    kind: str  # KV_LOAD | KV_STORE | KV_SPILL | KV_DROP
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    ram_slots: list[int] = field(default_factory=list)
    disk: list[bool] = field(default_factory=list)
    request_id: str | None = None
    params: dict[str, Any] | None = None


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
    # KV connector: the block copies this step starts (before its forward pass), and whether
    # earlier ones are still in flight: then the runner reports them even in a step without
    # tokens, and waits a little for one to end if it has nothing to compute.
    kv_transfers: list[KVTransfer] = field(default_factory=list)
    kv_in_flight: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to compute and nothing to transfer."""
        return (self.total_num_scheduled_tokens == 0 and not self.kv_transfers
                and not self.kv_in_flight)


# ----------------------------------------------------------------------------------------
# worker -> scheduler


@dataclass
class RunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    # One list per request in req_ids; empty while a prompt is still being prefilled in chunks.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    # Speculative decoding: per request in req_ids, drafts proposed to follow its new tokens.
    # With drafts verified this step, sampled_token_ids holds the accepted drafts then one more.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # KV connector: transfers (KVTransfer.op_id) that ended since the last output, and for
    # those where some blocks failed, their indexes into the transfer's keys.
    kv_finished: list[int] = field(default_factory=list)
    kv_failed: dict[int, list[int]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: req id -> (index in the prompt of the first token scored,
    # one entry per prompt token scored this step: its logprob given the tokens before it)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


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
    # Logprobs of prompt tokens 1, 2, ... (SamplingParams.prompt_logprobs): all of them, in the
    # request's first output with tokens
    prompt_logprobs: list[TokenLogprobs] | None = None

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
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing comes
    # before it); a delta output carries them once, in the first output that has them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
