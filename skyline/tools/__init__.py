"""Offline tools above the engine: they use its public API (`LLM` and the executor's methods)."""
