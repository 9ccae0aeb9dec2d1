"""Resolve user-facing engine arguments ("auto" values included) into a frozen EngineConfig.

resolve.py resolves the settings one at a time (device, dtype, quantization, KV cache dtype,
max_num_seqs, the model's path, the speculative models, KV offload), parallel.py the pipeline
stages and the parallel layout, assemble.py puts them together (`create_engine_config`).
"""

from skyline.engine.args import EngineArgs
from skyline.engine.create.assemble import create_engine_config
from skyline.engine.create.resolve import (
    CPU_BF16_KERNEL_FORMATS,
    CPU_MAX_NUM_SEQS,
    check_draft_vocab,
    resolve_device,
    resolve_model_path,
)

__all__ = ["CPU_BF16_KERNEL_FORMATS", "CPU_MAX_NUM_SEQS", "EngineArgs", "check_draft_vocab",
           "create_engine_config", "resolve_device", "resolve_model_path"]
