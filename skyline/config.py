"""Engine configuration: frozen dataclasses. "auto" values are resolved before freezing
(see `engine/create.py`); validation raises `ConfigError` with one sentence saying what to do."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A setting or a model file the user can fix; the message says how."""


@dataclass(frozen=True)
class ModelArch:
    """Architecture hyper-parameters, from a HF config.json or GGUF metadata."""

    architecture: str  # HF name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Sliding-window attention, per layer: a query sees the keys less than this many positions
    # before it (itself included); 0 sees its whole context. Empty: every layer full.
    sliding_windows: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model): each token runs num_experts_per_tok of
    # num_experts gated MLPs of moe_intermediate_size in every layer but `dense_layers`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of intermediate_size
    swiglu_limit: float | None = None  # gpt-oss: the clamp of its gated activation

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' field; is this a HF model?")
        arch = archs[0]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qk_norm = arch.startswith("Qwen3")
        bias = cfg.get("attention_bias", arch.startswith("Qwen2"))
        num_layers = cfg["num_hidden_layers"]
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
        if num_experts and not 0 < top_k <= num_experts:
            raise ConfigError(f"config.json routes each token to {top_k} of {num_experts} "
                              "experts; num_experts_per_tok must be between 1 and that")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_windows=_sliding_windows(cfg, arch, num_layers),
            num_experts=num_experts,
            num_experts_per_tok=top_k if num_experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size")
                                      or (cfg["intermediate_size"] if num_experts else 0)),
            # Mixtral always renormalizes; gpt-oss's softmax over the chosen logits sums to 1
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=_dense_layers(cfg, num_layers) if num_experts else (),
            swiglu_limit=cfg.get("swiglu_limit"),
        )


def _sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Per-layer windows as transformers applies them: `layer_types` where given (gpt-oss,
    configs saved by transformers 5); else Qwen's `use_sliding_window` (the layers from
    `max_window_layers` on; every layer of Qwen3-MoE); else `sliding_window` on every layer
    (Mistral, Mixtral)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not window:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json has sliding_window {window!r}; it must be a positive "
                          "number of tokens or null")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError("config.json's layer_types must list one type per layer")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"config.json has layer types {sorted(unknown)}, which skyline "
                              "does not support (only sliding_attention and full_attention)")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return ()
        first = 0 if arch.startswith("Qwen3Moe") else int(cfg.get("max_window_layers", 0))
        windows = tuple(window if i >= first else 0 for i in range(num_layers))
    else:
        windows = (window,) * num_layers
    return windows if any(windows) else ()


def _dense_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers of an MoE model with a dense MLP: Qwen3-MoE's `mlp_only_layers`, and those not on
    its `decoder_sparse_step`."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


QUANT_METHODS = ("none", "fp8", "int8", "int4", "mxfp4", "nvfp4", "gguf")
# The formats `skyline quantize` writes checkpoints of (quant/checkpoint.py), and the
# candidates its format search (`--search`) chooses from by default (quant/assignment.py).
SAVABLE_METHODS = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
DEFAULT_SEARCH_FORMATS = "mxfp4,nvfp4,int4,int4-g64,int4-g32,fp8,int8"
EXPERT_FORMATS = ("none", "fp8", "mxfp4")  # the formats MoE experts run in (ops/moe.py)
# Pre-quantized checkpoints of other tools that load onto skyline's formats (quant/external/).
CHECKPOINT_LAYOUTS = ("gptq", "awq", "compressed-tensors", "modelopt", "mxfp4")


@dataclass(frozen=True)
class CheckpointLayout:
    """How a pre-quantized checkpoint made by another tool stores its tensors; quant/external/
    repacks them into skyline's layout of QuantConfig.method while they load."""

    name: str  # one of CHECKPOINT_LAYOUTS
    bits: int = 4  # int formats: bits a code
    group_size: int = 0  # int formats: the checkpoint's group (0: one per output channel)
    symmetric: bool = True  # int formats without stored zero points: zero 2^(bits - 1)
    zero_offset: int = 0  # GPTQ's v1 format stores every zero point minus 1
    act_order: bool = False  # int formats: g_idx tensors put input columns in their groups
    weight_block: tuple[int, int] | None = None  # fp8: (rows, columns) of one weight scale
    static_input: bool = False  # fp8: activations quantized with a stored per-tensor scale
    # Checkpoint module names (e.g. "model.layers.0.mlp.down_proj") stored unquantized.
    full_precision: frozenset[str] = frozenset()


@dataclass(frozen=True)
class QuantConfig:
    """How Linear weights are stored and multiplied (skyline/quant/); embeddings and the LM
    head stay in the model dtype unless `lm_head` puts the head in fp8 (W8A8).
    `prequantized`: the checkpoint already holds the quantized tensors (written by `skyline
    quantize`); otherwise weights are quantized while loading.

    `layers` gives some Linears their own format (mixed precision): (pattern, method,
    group_size) triples, the first whose fnmatch pattern matches the Linear's module name
    (e.g. "model.layers.3.mlp.down_proj") wins; the others use `method` / `group_size`."""

    method: str = "none"  # one of QUANT_METHODS
    group_size: int = 128  # int8/int4: input elements per scale and zero point
    prequantized: bool = False
    layers: tuple[tuple[str, str, int], ...] = ()
    lm_head: bool = False  # --quantize-lm-head: the LM head in fp8 (W8A8), whatever `method`
    # MoE experts' own format where the checkpoint ships them in one (gpt-oss: "mxfp4",
    # prequantized, the rest of the model unquantized); "": each expert layer's format in
    # `method` / `layers`.
    experts: str = ""
    experts_prequantized: bool = False
    # A checkpoint of another tool (prequantized): how its tensors map onto `method`'s.
    layout: CheckpointLayout | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ConfigError(
                f"--quantization must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}"
            )
        if self.group_size not in (16, 32, 64, 128, 256, 512, 1024):
            raise ConfigError(
                f"--quant-group-size must be a power of two from 16 to 1024, got {self.group_size}"
            )
        for pattern, method, group_size in self.layers:
            if method == "gguf" or self.method == "gguf":
                raise ConfigError("GGUF blocks kept packed cannot be mixed with per-layer formats")
            QuantConfig(method=method, group_size=group_size)  # raises the one-sentence error
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"a per-layer format needs a layer name, got {pattern!r}")
        if self.experts not in ("", *EXPERT_FORMATS):
            raise ConfigError(f"MoE experts can be stored as {', '.join(EXPERT_FORMATS)}, not "
                              f"{self.experts!r}")

    def for_layer(self, name: str) -> QuantConfig:
        """The single-format config of the Linear named `name`."""
        for pattern, method, group_size in self.layers:
            if fnmatch.fnmatchcase(name, pattern):
                return QuantConfig(method, group_size, self.prequantized, layout=self.layout)
        return QuantConfig(self.method, self.group_size, self.prequantized, layout=self.layout)

    def expert_format(self, name: str) -> tuple[str, bool]:
        """(format, prequantized) of the MoE expert layer named `name` (GGUF experts are
        dequantized while loading: the MoE kernels take none of its block types)."""
        if self.experts:
            return self.experts, self.experts_prequantized
        method = self.for_layer(name).method
        return ("none", False) if method == "gguf" else (method, self.prequantized)


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
    # `model` by engine/create.py; or, with `draft_layers` N > 0 and no draft model, the target's
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
    (device, first layer, end layer) per pipeline stage, resolved by engine/create.py from
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
