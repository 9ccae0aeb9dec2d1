"""skyline: an LLM inference engine and serving stack."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Idle OpenMP workers sleep instead of spinning: spinning workers make CPU decode several times
# slower whenever another process wants a core, at a cost of ~15% on a quiet machine
# (bench/omp_wait_policy.py). OpenMP reads this once, when torch loads it, so it is set here,
# before skyline imports torch; spawned engine processes inherit it. A user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from skyline.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from skyline.engine.frontend import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import skyline` light for the HTTP front end and tools.
    if name == "LLM":
        from skyline.engine.frontend import LLM

        return LLM
    raise AttributeError(name)
