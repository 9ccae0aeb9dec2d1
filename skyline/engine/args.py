"""EngineArgs: every engine knob a user can set, as given (no torch here: the CLI and the HTTP
front end build it before any model code loads). `engine/create/` resolves it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    """Every engine knob a user can set, with "auto" defaults (one source for CLI and API)."""

    model: str | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | int = "2GiB"
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 (alias fp8_e4m3)
    kv_offload_ram: str | int = 0  # pinned host RAM for KV blocks beyond the device
    kv_offload_disk: str | None = None  # a directory for KV blocks (survives restarts)
    kv_offload_disk_size: str | int | None = None  # None: 90% of the free space
    kv_offload_policy: str = "eviction"  # eviction | eager
    kv_offload_dtype: str = "auto"  # auto | fp8 | int8: blocks in the lower tiers
    max_num_seqs: int | str | None = "auto"  # "auto" (or None): from the KV cache on GPUs
    max_num_batched_tokens: int | None = None
    max_waiting: int = 0
    schedule_conservativeness: float = 1.0  # KV headroom at admission (sched/headroom.py)
    seed: int = 0
    served_model_name: str | None = None
    threads: int | None = None  # CPU threads for torch
    quantization: str | None = None  # None: the checkpoint's own format (see quant/resolve.py)
    quant_group_size: int = 128
    quantize_lm_head: bool = False  # the LM head in fp8 (W8A8), with any --quantization
    enforce_eager: bool = False  # CUDA: run every step eagerly, no CUDA graphs
    async_scheduling: str = "auto"  # auto (on for CUDA) | on | off
    speculative_method: str = "none"  # none | ngram | suffix | eagle | draft
    # eagle: the head's directory; None with the default model: the head shipped for it.
    # draft: the draft model (HF directory, .gguf file or shipped config name)
    speculative_model: str | None = None
    speculative_draft_layers: int = 0  # draft without a model: the target's first N layers
    eagle_lookup: bool = True  # eagle: prompt lookup for spans the request repeats
    num_speculative_tokens: int = 5
    ngram_min: int = 2
    ngram_max: int = 5
    speculative_max_batch_tokens: int | None = None  # None: auto (by device)
    speculative_gate: bool = True  # speculate only where it was measured faster
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    placement: str | None = None  # auto | DEVICE=LAYERS,... (one pipeline stage each)
    expert_parallel: bool = False  # MoE: whole experts over a stage's ranks, tokens moved
    n_cpu_moe: int = 0  # MoE: the experts of the first N layers in host memory, on the CPU
    distributed_executor: str = "auto"  # auto (mp beyond one rank) | uni | mp
    distributed_init: str | None = None  # tcp://HOST:PORT: the rendezvous across hosts
    nnodes: int = 1
    node_rank: int = 0
    distributed_timeout: float = 600.0  # seconds a rank may go unheard
    role: str = "both"  # both | prefill | decode (a replica behind `skyline router`)
    kv_events_host: str = "127.0.0.1"
    kv_events_port: int | None = None  # publish KV events here (ZMQ PUB; snapshots on +1)
    kv_transfer_port: int | None = None  # prefill role: the KV transfer socket (None: any)
