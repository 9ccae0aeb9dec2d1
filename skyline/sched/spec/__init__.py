"""Speculative decoding, the scheduler's side: `policy` (how many drafts each request verifies,
the acceptance metrics) and `gate` (whether a step speculates at all, measured per batch
size). Plain Python; the proposals come from the runner."""

from skyline.sched.spec.gate import SpecGate
from skyline.sched.spec.policy import SpecPolicy

__all__ = ["SpecGate", "SpecPolicy"]
