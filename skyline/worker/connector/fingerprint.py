"""What must match for one engine to read another's KV blocks: the model (its files, or the
seed of random weights), its compute and KV dtypes, the fp8 KV scales, the block size, the
lower tiers' dtype, and the parallel layout (which shard of which layers this rank holds).

Keys on disk are this fingerprint plus each block's chained hash (cache/prefix.py), so two
engines share blocks exactly when they would compute the same KV, and never otherwise.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Any

from skyline.config import EngineConfig, ModelConfig

# Bumped when the block payload's layout changes: old files are then never read.
FORMAT_VERSION = 1


def model_identity(m: ModelConfig) -> dict[str, Any]:
    """The weights' identity without reading them: each weight file's name, size and
    modification time (a changed or replaced file is another model); random weights: the
    seed."""
    files = []
    if m.load_format == "dummy":
        files.append(("dummy", m.seed))
    else:
        paths = [m.path] if os.path.isfile(m.path) else sorted(
            glob.glob(os.path.join(m.path, "*.safetensors"))
            + glob.glob(os.path.join(m.path, "*.gguf")))
        for p in paths:
            st = os.stat(p)
            files.append((os.path.basename(p), st.st_size, st.st_mtime_ns))
    return {"arch": dataclasses.asdict(m.arch), "format": m.load_format,
            "quant": dataclasses.asdict(m.quant), "files": files}


def fingerprint(config: EngineConfig, kv_dtype: str, kv_scales: list[tuple[float, float]],
                block_shape: tuple[int, ...], rank: dict[str, int]) -> bytes:
    """16 bytes naming everything a block's bytes depend on besides its tokens. `block_shape`:
    this rank's [layers, 2, block_size, kv_heads, head_dim]; `rank`: its place in the
    parallel layout (tensor and pipeline rank and size)."""
    ident = {
        "version": FORMAT_VERSION,
        "model": model_identity(config.model),
        "dtype": config.model.dtype,
        "kv_dtype": kv_dtype,
        "kv_scales": kv_scales,
        "block_shape": list(block_shape),
        "offload_dtype": config.offload.dtype,
        "rank": dict(sorted(rank.items())),
    }
    text = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()[:16]
