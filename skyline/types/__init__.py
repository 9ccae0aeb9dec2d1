"""Plain data shared across layers. No torch here: these cross process and layer boundaries.

`SchedulerOutput` (scheduler -> worker) and `RunnerOutput` (worker -> scheduler) are the whole
contract between bookkeeping and compute. New requests are sent whole, known ones as diffs.
request.py holds a request and its sampling parameters, step.py the messages of one engine
step, kv_events.py what a replica tells the router about its prefix cache.
"""

from skyline.types.kv_events import KVEventBatch, KVEventKind, KVSnapshot
from skyline.types.request import (
    INT64_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    Request,
    RequestStatus,
    SamplingParams,
    TokenLogprobs,
    is_valid_unicode,
)
from skyline.types.step import (
    KV_DROP,
    KV_LOAD,
    KV_SEND,
    KV_SPILL,
    KV_STORE,
    CachedRequestData,
    CompletionOutput,
    KVTransfer,
    NewRequestData,
    RequestOutput,
    RunnerOutput,
    SchedulerOutput,
    StepOutput,
)

__all__ = [
    "INT64_LIMIT", "KV_DROP", "KV_LOAD", "KV_SEND", "KV_SPILL", "KV_STORE", "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS", "CachedRequestData", "CompletionOutput", "KVEventBatch", "KVEventKind",
    "KVSnapshot", "KVTransfer", "NewRequestData", "Request", "RequestOutput", "RequestStatus",
    "RunnerOutput", "SamplingParams", "SchedulerOutput", "StepOutput", "TokenLogprobs",
    "is_valid_unicode",
]
