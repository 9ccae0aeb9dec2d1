"""The engine's settings, one frozen dataclass per concern, joined in `EngineConfig`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from skyline.config.arch import ConfigError, ModelArch
from skyline.config.quant import QuantConfig


@dataclass(frozen=True)
class ModelConfig:
    path: str  # HF directory, .gguf file, or a directory holding config.json (dummy)
    load_format: str  # "safetensors" | "gguf" | "dummy"
    arch: ModelArch
    dtype: str  # "float32" | "bfloat16" | "float16"
    max_model_len: int
    seed: int = 0
    name: str = ""  # served model name
    quant: QuantConfig = field(default_factory=QuantConfig)


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total memory skyline may use
    kv_cache_memory: int = 2 << 30  # CPU: bytes for the KV cache
    num_blocks: int | None = None  # fixed block count (tests); overrides both
    enable_prefix_caching: bool = True
    # one of KV_CACHE_DTYPES; fp8_e4m3: float8_e4m3fn with per-layer K/V scales, twice the
    # tokens of a bf16 cache in the same memory (ops/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # The block pool logs the hashes it stores and evicts (KV events, for a router's index);
    # set where FleetConfig.kv_events_port is.
    kv_events: bool = False


KV_OFFLOAD_POLICIES = ("eviction", "eager")
KV_OFFLOAD_DTYPES = ("auto", "fp8", "int8")  # auto: the device cache's own bytes


@dataclass(frozen=True)
class OffloadConfig:
    """KV cache beyond the device (cache/tiers.py, worker/connector/): blocks written down to
    pinned host RAM and a disk directory, keyed by their chained hashes, and restored instead
    of recomputed. `policy` eviction: a device block is written down as it nears eviction, a
    RAM block is spilled to disk the same way; eager: every full block is written to every
    tier as soon as it is computed. `dtype` fp8 / int8: the lower tiers hold blocks quantized
    per token and head with float32 scales (about half the bytes of a 16-bit cache; lossy)."""

    ram_bytes: int = 0  # pinned host RAM; 0 with a disk: a small write buffer only
    disk_dir: str | None = None
    disk_bytes: int | None = None  # None: 90% of the free space at start-up
    policy: str = "eviction"  # one of KV_OFFLOAD_POLICIES
    dtype: str = "auto"  # one of KV_OFFLOAD_DTYPES

    def __post_init__(self) -> None:
        if self.policy not in KV_OFFLOAD_POLICIES:
            raise ConfigError(f"--kv-offload-policy must be eviction or eager, got {self.policy!r}")
        if self.dtype not in KV_OFFLOAD_DTYPES:
            raise ConfigError(f"--kv-offload-dtype must be auto, fp8 or int8, got {self.dtype!r}")
        if self.ram_bytes < 0 or (self.disk_bytes is not None and self.disk_bytes < 0):
            raise ConfigError("--kv-offload-ram and --kv-offload-disk-size must not be negative")

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0 or self.disk_dir is not None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # running requests at most
    # max_num_seqs "auto": the runner chooses it once the KV cache is sized (max_num_seqs is
    # then the bound it sized for); the engine core takes the runner's choice
    max_num_seqs_auto: bool = False
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunk + decodes)
    max_model_len: int = 8192
    max_waiting: int = 0  # waiting-queue limit for the server (0: unbounded)
    # KV held back at admission for running requests' expected output, as a multiple of the
    # learned estimate (sched/headroom.py); 0: admit on current need alone
    schedule_conservativeness: float = 1.0


SPEC_METHODS = ("none", "ngram", "suffix", "eagle", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (worker/spec/): proposers guess up to `num_speculative_tokens`
    tokens per request, the target verifies them in one pass. `max_batch_tokens`: steps whose
    batch (before drafts) exceeds this many tokens are compute-bound and do not speculate."""

    method: str = "none"  # one of SPEC_METHODS
    num_speculative_tokens: int = 5
    ngram_min: int = 2  # shortest suffix match that yields a proposal
    ngram_max: int = 5  # longest suffix match tried (first)
    max_batch_tokens: int = 16
    # Cost of one verified draft token relative to a decode step: a draft is verified only
    # while its chance of acceptance exceeds this (sched/spec/policy.py).
    draft_cost: float = 0.3
    # Measured gate (sched/spec/gate.py): speculate only in batch sizes where speculative steps
    # were measured to emit more tokens per second than plain ones. False: always speculate
    # (within max_batch_tokens).
    gate: bool = True
    suffix_traffic_tokens: int = 1 << 18  # suffix: tokens of recent requests kept indexed
    # eagle: directory of the head (`skyline train-speculator`); draft: the draft model's path
    model: str | None = None
    # draft: the draft model (a smaller model with the target's tokenizer), resolved from
    # `model` by engine/create/; or, with `draft_layers` N > 0 and no draft model, the target's
    # own first N layers, final norm and LM head (weights shared, own KV cache)
    draft: ModelConfig | None = None
    draft_layers: int = 0
    # eagle: prompt lookup's continuation instead of the head's drafts while the request
    # repeats its own text (its last ngram_max tokens occurred before in it)
    eagle_lookup: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"--speculative-method must be one of {', '.join(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ConfigError("--num-speculative-tokens must be between 1 and 64")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError("the n-gram sizes must satisfy 1 <= ngram_min <= ngram_max <= 64")
        if self.max_batch_tokens < 1:
            raise ConfigError("the speculation batch-token limit must be at least 1")
        if not 0 <= self.draft_cost < 1:
            raise ConfigError(f"draft_cost must be in [0, 1), got {self.draft_cost}")
        if self.method == "eagle" and not self.model:
            raise ConfigError("--speculative-method eagle needs --speculative-model DIR, a head "
                              "written by `skyline train-speculator`")
        if self.draft_layers < 0:
            raise ConfigError(
                f"--speculative-draft-layers must be positive, got {self.draft_layers}")
        if self.draft_layers and self.method != "draft":
            raise ConfigError("--speculative-draft-layers needs --speculative-method draft")
        if self.method == "draft" and self.draft is None and not self.draft_layers:
            raise ConfigError("--speculative-method draft needs --speculative-model PATH (a "
                              "smaller model with the target's tokenizer) or "
                              "--speculative-draft-layers N")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


EXECUTORS = ("uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes (worker/executor/, parallel/). `stages`: one
    (device, first layer, end layer) per pipeline stage, resolved by engine/create/parallel.py from
    --pipeline-parallel-size or --placement; each stage runs `tensor_parallel_size` ranks.
    `executor` "uni" runs the one rank in the engine's process, "mp" every rank in a process of
    its own. Across hosts, ranks meet at `distributed_init` (tcp://HOST:PORT: the engine's
    rendezvous store), `nnodes` hosts each starting its share of the ranks."""

    tensor_parallel_size: int = 1
    stages: tuple[tuple[str, int, int], ...] = ()  # () until resolved: one stage, the device
    executor: str = "uni"
    distributed_init: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # Seconds a rank may go unheard before the engine stops (heartbeats; a collective waits
    # as long before it fails).
    timeout_s: float = 600.0
    # CPU threads of each rank on a CPU (--threads); None: the host's cores shared by them
    threads: int | None = None
    # MoE layers spread whole experts over each stage's tensor-parallel ranks and move tokens
    # to them by all-to-all (parallel/experts.py's AllToAllPlacement); attention stays split
    expert_parallel: bool = False
    # the experts of the MoE layers among the first `n_cpu_moe` layers live in host memory and
    # run on the CPU, the rest of the model on the stage's device (llama.cpp's --n-cpu-moe)
    n_cpu_moe: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"--distributed-executor must be one of {', '.join(EXECUTORS)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1} with --nnodes "
                              f"{self.nnodes}")
        if self.n_cpu_moe < 0:
            raise ConfigError("--n-cpu-moe must be 0 or more")
        if self.world_size % self.nnodes:
            raise ConfigError(f"{self.world_size} ranks cannot be shared evenly by --nnodes "
                              f"{self.nnodes}")

    @property
    def pipeline_parallel_size(self) -> int:
        return max(1, len(self.stages))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class FleetConfig:
    """This engine as one replica of a fleet behind `skyline router` (router/).

    `role`: what the router sends it (prefill-only work, decodes, or both). `kv_events_port`:
    the engine publishes its KV events (types.KVEventBatch) on a ZMQ PUB socket bound at
    `kv_events_host:kv_events_port` and answers snapshot requests on the port after it;
    None: no events. A prefill or decode replica moves KV through the KV connector
    (cache/pd.py, worker/connector/pd.py)."""

    role: str = "both"
    kv_events_host: str = "127.0.0.1"
    kv_events_port: int | None = None
    # prefill: the port its KV transfer socket binds on kv_events_host (None: any free one)
    kv_transfer_port: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_events_port is not None and not 1 <= self.kv_events_port < 65535:
            raise ConfigError(f"--kv-events-port must be a TCP port below 65535 (it uses the "
                              f"next one too), got {self.kv_events_port}")


POLICIES = ("cache-aware", "round-robin", "least-load")


@dataclass(frozen=True)
class RouterConfig:
    """`skyline router`: replicas (URLs) and how requests are spread over them (router/)."""

    replicas: tuple[str, ...]
    policy: str = "cache-aware"  # cache-aware | round-robin | least-load
    balance_abs: int = 4  # cache-aware: overloaded at this many more open requests ...
    balance_rel: float = 1.5  # ... and this many times as many as the least-loaded replica
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    max_attempts: int = 3  # replicas a request may be tried on before it starts
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 16 << 20
    api_key: str | None = None  # required of clients, and sent to the replicas
    # Prefill/decode: prompts shorter than this many tokens (after prefix hits on the decode
    # replica) are prefilled where they decode; the KV of longer ones is prefilled on a
    # prefill replica and moved.
    pd_min_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("give at least one replica (--replica http://HOST:PORT)")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, "
                              f"got {self.policy!r}")
        if self.balance_abs < 0 or self.balance_rel < 1:
            raise ConfigError("--balance-abs must be >= 0 and --balance-rel >= 1")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ConfigError("--health-interval and --health-timeout must be positive")
        if self.max_attempts < 1 or self.connect_timeout_s <= 0:
            raise ConfigError("--max-attempts must be at least 1 and the timeouts positive")
        if self.pd_min_prompt_tokens < 0:
            raise ConfigError("--pd-min-prompt-tokens must be >= 0")


@dataclass(frozen=True)
class TrainArgs:
    """Training of an EAGLE head (`skyline train-speculator`, worker/spec/train.py)."""

    epochs: int = 4
    steps: int | None = None  # stop after this many optimizer steps (None: the epochs)
    lr: float = 2e-3
    batch_tokens: int = 2048  # head positions per optimizer step
    unroll: int = 3  # training-time test passes (1: plain teacher forcing)
    unroll_decay: float = 0.8  # weight of pass s: decay ** s
    noise: float = 0.1  # uniform input noise, relative to the features' RMS
    reg_weight: float = 0.5  # weight of the feature regression term
    draft_vocab: int = 8192  # tokens the head may propose: the most frequent in the data
    val_fraction: float = 0.05  # sequences held out for the acceptance estimate
    seed: int = 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    enforce_eager: bool = False  # CUDA: no CUDA graphs (debugging, profiling)
    spec: SpecConfig = field(default_factory=SpecConfig)
    # Schedule step n+1 while the device runs step n (engine/core.py).
    async_scheduling: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)

    def __post_init__(self) -> None:
        c, s = self.cache, self.scheduler
        if c.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"--block-size must be a power of two up to 128, got {c.block_size}")
        if not 0 < c.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be auto or fp8, got {c.kv_cache_dtype!r}")
        if s.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if s.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if s.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        if self.offload.enabled and not c.enable_prefix_caching:
            raise ConfigError("KV offload keeps blocks by their prefix hashes; drop "
                              "--no-prefix-caching or the --kv-offload-* flags")
        if self.offload.dtype != "auto" and c.kv_cache_dtype != "auto":
            raise ConfigError("--kv-offload-dtype compresses a 16- or 32-bit KV cache; with "
                              "--kv-cache-dtype fp8 the blocks are moved as they are: drop it")


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GiB', '512M', '1.5g', 1073741824 -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 2GiB or 512MiB")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)
