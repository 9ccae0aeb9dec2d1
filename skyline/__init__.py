"""skyline: an LLM inference engine and serving stack."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skyline.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from skyline.engine.frontend.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import skyline` light for the HTTP front end and tools.
    if name == "LLM":
        from skyline.engine.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
