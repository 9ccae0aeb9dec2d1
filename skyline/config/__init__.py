"""Engine configuration: frozen dataclasses. "auto" values are resolved before freezing
(see `engine/create/`); validation raises `ConfigError` with one sentence saying what to do.
arch.py: the model's architecture (config.json); quant.py: quantization formats; engine.py:
the engine's settings, joined in `EngineConfig`."""

from skyline.config.arch import (
    ConfigError,
    ModelArch,
)
from skyline.config.engine import (
    EXECUTORS,
    KV_CACHE_DTYPES,
    KV_OFFLOAD_DTYPES,
    KV_OFFLOAD_POLICIES,
    POLICIES,
    ROLES,
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    FleetConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    RouterConfig,
    SchedulerConfig,
    SpecConfig,
    TrainArgs,
    parse_size,
)
from skyline.config.quant import (
    CHECKPOINT_LAYOUTS,
    DEFAULT_SEARCH_FORMATS,
    EXPERT_FORMATS,
    QUANT_METHODS,
    SAVABLE_METHODS,
    CheckpointLayout,
    QuantConfig,
)

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "CacheConfig",
    "CheckpointLayout",
    "ConfigError",
    "DEFAULT_SEARCH_FORMATS",
    "EXECUTORS",
    "EXPERT_FORMATS",
    "EngineConfig",
    "FleetConfig",
    "KV_CACHE_DTYPES",
    "KV_OFFLOAD_DTYPES",
    "KV_OFFLOAD_POLICIES",
    "ModelArch",
    "ModelConfig",
    "OffloadConfig",
    "POLICIES",
    "ParallelConfig",
    "QUANT_METHODS",
    "QuantConfig",
    "ROLES",
    "RouterConfig",
    "SAVABLE_METHODS",
    "SPEC_METHODS",
    "SchedulerConfig",
    "SpecConfig",
    "TrainArgs",
    "parse_size",
]
