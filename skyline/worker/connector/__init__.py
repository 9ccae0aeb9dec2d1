"""The worker's half of the KV connector (base.py): the tiers beyond the device — pinned host
RAM (host.py) and a disk directory (disk.py), blocks encoded by codec.py and named by
fingerprint.py — and the prefill/decode transport to another replica (pd.py)."""

from __future__ import annotations

import torch

from skyline.config import ConfigError, EngineConfig
from skyline.worker.connector.base import KVConnector


def make_connector(config: EngineConfig, kv_caches: list[torch.Tensor],
                   kv_scales: list[tuple[float, float]],
                   rank: dict[str, int] | None = None) -> KVConnector | None:
    """The rank's connector for `config`, or None when KV stays on the device."""
    if config.fleet.role != "both":
        if config.offload.enabled:
            raise ConfigError("a prefill or decode replica (--role) cannot have KV tiers "
                              "(--kv-offload-*) yet; give one or the other")
        from skyline.worker.connector.pd import PDTransport

        return PDTransport(config, kv_caches)
    if not config.offload.enabled:
        return None
    from skyline.worker.connector.tiers import TierWorker

    return TierWorker(config, kv_caches, kv_scales, rank)
