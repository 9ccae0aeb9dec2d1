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
        )


QUANT_METHODS = ("none", "fp8", "int8", "int4", "mxfp4", "nvfp4", "gguf")


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

    def for_layer(self, name: str) -> QuantConfig:
        """The single-format config of the Linear named `name`."""
        for pattern, method, group_size in self.layers:
            if fnmatch.fnmatchcase(name, pattern):
                return QuantConfig(method, group_size, self.prequantized)
        return QuantConfig(self.method, self.group_size, self.prequantized)


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


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # running requests at most
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

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"--distributed-executor must be one of {', '.join(EXECUTORS)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1} with --nnodes "
                              f"{self.nnodes}")
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
